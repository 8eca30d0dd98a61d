"""Load a target from a hub id, a local HF directory, a ``.gguf`` file, or ``demo``.

Every spec resolves to something ``from_pretrained`` reads (a directory or a hub id); GGUF
files and the demo go through a one-time conversion into the eyas cache. Errors list what was
tried. Default precision: bf16 on GPU, fp32 on CPU; on GPU the weights are placed with
``device_map="auto"`` so a target larger than one GPU spans several.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from eyas.errors import EyasError, TargetNotFoundError
from eyas.target.gguf import demo_gguf_path, ensure_hf_dir_from_gguf
from eyas.target.gguf_header import gguf_config, read_gguf_header
from eyas.target.layout import discover_layout
from eyas.target.loaded import Target

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a target spec names (``demo``'s, or a path ending in ``.gguf``), or None for other specs."""
    if spec == "demo":
        return demo_gguf_path()
    path = Path(spec).expanduser()
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise TargetNotFoundError(f"target {spec!r}: GGUF file {path} does not exist")
    return path


def resolve_target(spec: str) -> str:
    """Turn a target spec into a local HF directory or a hub id (converting GGUF/demo once)."""
    gguf = gguf_file(spec)
    if gguf is not None:
        return str(ensure_hf_dir_from_gguf(gguf))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetNotFoundError(
                f"target {spec!r}: directory {path} has no config.json; point at an HF model directory "
                "(config.json + weights), a .gguf file, a hub id, or 'demo'"
            )
        return str(path)
    if path.exists():
        raise TargetNotFoundError(
            f"target {spec!r}: {path} is a file but not a .gguf; give an HF model directory, a .gguf file, "
            "a hub id, or 'demo'"
        )
    if not _HUB_ID.match(spec):
        raise TargetNotFoundError(
            f"target {spec!r}: tried local path {path} (does not exist); it is not a hub id either "
            "(those look like 'owner/name')"
        )
    return spec


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_device(device: torch.device | str) -> torch.device:
    """``--device`` as a torch device that this machine has, or one line saying what it has: a CUDA device asked for
    where torch sees none would otherwise be placed on the CPU without a word (transformers' device_map)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise EyasError(f"--device {device}: torch sees no CUDA device on this machine (a CPU-only build of torch, or no "
                        "GPU visible: CUDA_VISIBLE_DEVICES); pass --device cpu, or leave --device out (the CPU then)")
    if device.index is not None and device.index >= count:
        raise EyasError(f"--device {device}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                        f"(cuda:0{f' … cuda:{count - 1}' if count > 1 else ''}); pass one of them")
    return device


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPU (what engines serve), fp32 on CPU (exact, and fast enough for tiny models)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_target_config(spec: str, trust_remote_code: bool = False):
    """Load only the config of a target (no weights); returns (config, source)."""
    from transformers import AutoConfig

    from eyas.target.rehearsal import register_rehearsal_target

    register_rehearsal_target()  # the rehearsal target's head directories load anywhere
    source = resolve_target(spec)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code), source
    except (OSError, ValueError) as err:
        raise TargetNotFoundError(_tried(spec, source, err)) from err


def read_target_config(spec: str, trust_remote_code: bool = False):
    """The target's config, reading no weights and converting nothing: a GGUF's (the demo's) from its header
    (:func:`eyas.target.gguf_header.gguf_config`), any other's as :func:`load_target_config` reads it. For checks that
    answer before a GGUF's one-time conversion (the demo's takes most of a minute)."""
    gguf = gguf_file(spec)
    if gguf is not None:
        return gguf_config(read_gguf_header(gguf))
    return load_target_config(spec, trust_remote_code)[0]


def ships_chat_template(spec: str) -> bool | None:
    """Whether a GGUF target (the demo's too) carries a chat template, read from its header without converting it;
    None for any other target (its tokenizer tells, and loads in moments) and for a GGUF without a tokenizer."""
    gguf = gguf_file(spec)
    if gguf is None:
        return None
    header = read_gguf_header(gguf)
    return header.has_chat_template if header.has_tokenizer else None


def build_skeleton(config, trust_remote_code: bool = False) -> nn.Module:
    """Instantiate the architecture on the meta device: the module tree without any weights."""
    with torch.device("meta"):
        return build_from_config(config, trust_remote_code)


def build_from_config(config, trust_remote_code: bool = False, **kwargs) -> nn.Module:
    """The architecture of ``config``, its weights initialised as transformers does (``kwargs`` to ``from_config``,
    e.g. ``dtype``): the class :func:`load_target` would load it with."""
    return _from_loader(lambda cls: cls.from_config(config, trust_remote_code=trust_remote_code, **kwargs), config)


def load_target(
    spec: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> Target:
    """Load model, tokenizer and layout of a target spec, ready for capture."""
    device = require_device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    config, source = load_target_config(spec, trust_remote_code)
    placement = {"device_map": "auto"} if device.type == "cuda" and device.index is None else {}

    def load(cls):
        return cls.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code, **placement)

    try:
        model = _from_loader(load, config)
    except OSError as err:
        raise TargetNotFoundError(_tried(spec, source, err)) from err
    if not placement:
        model.to(device)
    model.eval()
    return Target(model=model, tokenizer=load_tokenizer(source), layout=discover_layout(model), spec=spec, source=source)


def load_tokenizer(source: str, trust_remote_code: bool = False):
    """The target's tokenizer, or None when the source ships none (e.g. a config-only directory)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return None


def stop_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a turn, in a fixed order: the generation config's (often several), then the tokenizer's."""
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def _from_loader(load, config) -> nn.Module:
    """Try the causal-LM auto class, then the image-text one (multimodal wrappers)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    errors = []
    for cls in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            return load(cls)
        except ValueError as err:  # "Unrecognized configuration class ..." for this auto class
            errors.append(f"{cls.__name__}: {str(err).splitlines()[0]}")
    raise TargetNotFoundError(
        f"no causal-LM class in transformers for model_type {getattr(config, 'model_type', '?')!r} "
        f"(architectures {getattr(config, 'architectures', None)}); tried " + "; ".join(errors)
        + ". If the model ships its own code, pass --trust-remote-code"
    )


def _tried(spec: str, source: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = f"local directory {source}" if Path(source).is_dir() else f"hub id {source!r} (local path ./{spec} does not exist)"
    return f"target {spec!r}: tried {where}: {first}"
