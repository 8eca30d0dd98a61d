"""The files of a drafter directory: reading whoever wrote it, and writing eyas' own.

eyas, SpecForge and speculators write ``model.safetensors`` (large ones shard it behind
``model.safetensors.index.json``); the EAGLE reference releases ship ``pytorch_model.bin``. A .bin
is a pickle, so it is only ever opened with ``torch.load(weights_only=True)``, which refuses
anything but tensors and plain containers. Names are normalised to eyas' (``midlayer.*``, no
``model.`` prefix), the spellings engines map the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.errors import EyasError

_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
                torch.int32: "I32", torch.bool: "BOOL"}


def eyas_name(name: str) -> str:
    """``model.layers.0.x`` / ``layers.0.x`` / ``midlayer.x`` → ``midlayer.x``; other names lose a ``model.`` prefix."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def weight_files(directory: Path) -> list[Path]:
    """The files holding the weights, or an error saying what a drafter directory must contain."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise EyasError(f"{index} names shards that are not there: {missing}")
        return [directory / s for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return [directory / name]
    raise EyasError(f"{directory} holds no weights: expected model.safetensors (or its sharded index, or an EAGLE "
                    "reference pytorch_model.bin)")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # weights_only refuses pickled code: say so instead of a pickle traceback
        raise EyasError(f"{path} could not be read as plain tensors ({type(err).__name__}: {str(err)[:200]}); eyas never "
                        "unpickles code: convert it to safetensors") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EyasError(f"{path} is not a flat name → tensor state dict")
    return state


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory, under eyas names."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        if path.suffix == ".bin":
            state = _load_bin(path)
        else:
            with safe_open(str(path), framework="pt") as f:
                state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 — safe_open is not a dict
        for name, tensor in state.items():
            out[eyas_name(name)] = tensor
    return out


def read_shapes(directory: Path, normalise: bool = True) -> dict[str, tuple[list[int], str]]:
    """name → (shape, safetensors dtype name), without reading safetensors data; eyas spelling when
    ``normalise``, else as stored (``eyas check`` judges the stored names)."""
    rename = eyas_name if normalise else str
    out: dict[str, tuple[list[int], str]] = {}
    for path in weight_files(directory):
        if path.suffix == ".bin":
            for name, tensor in _load_bin(path).items():
                out[rename(name)] = (list(tensor.shape), _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)))
            continue
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        for name, info in header.items():
            out[rename(name)] = (list(info["shape"]), info["dtype"])
    return out


DRAFT_FILES = ("config.json", "model.safetensors", "README.md")


def write_draft_dir(out: Path, config: dict, tensors: dict[str, torch.Tensor], card: str,
                    then: Callable[[Path], object] | None = None) -> Path:
    """Write config.json, model.safetensors and README.md into ``out``, atomically (:func:`eyas.io.atomic_dir`); ``then``
    is called with the filled temporary directory before it takes ``out``'s place (export writes manifest.json there)."""
    from safetensors.torch import save_file

    from eyas.io import atomic_dir

    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(card)
        if then is not None:
            then(tmp)
    return Path(out)
