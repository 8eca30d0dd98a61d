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
from eyas.manifest import MANIFEST, REMEDIES, file_problem, output_problems, read_json_object, read_stage_manifest

_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
                torch.int32: "I32", torch.bool: "BOOL"}


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # `eyas export --dtype`'s


def torch_dtype_name(dtype: str) -> str:
    """config.json's ``torch_dtype`` for an export dtype: bf16 → "bfloat16"."""
    return str(TORCH_DTYPES[dtype]).removeprefix("torch.")


_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
               "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_INTACT_COPY = "replace it with an intact copy (an eyas drafter: eyas export it again)"


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
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise EyasError(f"{index} is not a safetensors index (JSON with a weight_map): damaged; {_INTACT_COPY}") from None
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


def safetensors_header(path: Path, remedy: str = _INTACT_COPY) -> dict[str, dict]:
    """A safetensors file's tensor table (name → dtype, shape, data_offsets), checked against the file: a truncated,
    padded or garbled file is an error naming it and ``remedy`` (what to do), not a crash when a tensor is read."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < length <= min(size - 8, 100 * 2**20):
            raise EyasError(f"{path} is not a readable safetensors file ({size:,} bytes, header length {length:,}): "
                            f"truncated or another format; {remedy}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise EyasError(f"{path} has a garbled safetensors header (not a JSON object): damaged; {remedy}")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            expected = count * _ITEM_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise EyasError(f"{path}: the header entry of tensor {name} is malformed: damaged; {remedy}") from None
        if begin < 0 or stop - begin != expected:
            raise EyasError(f"{path}: tensor {name} spans bytes {begin}..{stop}, its shape and dtype need {expected:,}: "
                            f"damaged; {remedy}")
        end = max(end, stop)
    if end != size - 8 - length:
        raise EyasError(f"{path} holds {size - 8 - length:,} bytes of tensor data where its header needs {end:,}: "
                        f"{'truncated' if end > size - 8 - length else 'damaged'}; {remedy}")
    return header


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory, under eyas names."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        if path.suffix == ".bin":
            state = _load_bin(path)
        else:
            safetensors_header(path)
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
        for name, info in safetensors_header(path).items():
            out[rename(name)] = (list(info["shape"]), info["dtype"])
    return out


def integrity_problems(directory: Path) -> list[str]:
    """Damage to a drafter's weight files: against the sizes and SHA-256 its manifest.json records when eyas export
    wrote it, else by each safetensors file's header and size (a truncation; changed bytes need the manifest)."""
    directory = Path(directory)
    manifest = export_manifest(directory)
    if isinstance(manifest, str):
        return [manifest]
    recorded = {r["file"]: r for r in manifest.get("outputs") or []}
    try:
        files = weight_files(directory)
    except EyasError as err:
        return [str(err)]
    problems = []
    for path in files:
        record = recorded.get(path.name)
        if record is not None:
            problem = file_problem(path, record["bytes"], record.get("sha256"))
            if problem is not None:
                problems.append(f"{path}: {problem}; {REMEDIES['export']}")
        elif path.suffix == ".safetensors":
            try:
                safetensors_header(path)
            except EyasError as err:
                problems.append(str(err))
    return problems


def export_manifest(directory: Path) -> dict | str:
    """DRAFT_DIR's manifest.json ({} when there is none: another tool's drafter), or what is wrong with it."""
    if not (directory / MANIFEST).is_file():
        return {}
    try:
        return read_stage_manifest(directory, "export")
    except EyasError as err:
        return str(err)


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


def edited_since_export(directory: Path) -> list[str]:
    """Files besides the weights that differ from what eyas export recorded (a config edited by hand, say)."""
    manifest = export_manifest(directory)
    if isinstance(manifest, str):
        return []  # integrity_problems reports it
    others = [r for r in manifest.get("outputs") or [] if not r["file"].endswith((".safetensors", ".bin"))]
    return [f"{problem}: edited after eyas export wrote it? The checks judge it as it is now"
            for problem in output_problems(directory, {"outputs": others})]


def read_draft_config(directory: Path) -> dict:
    """A drafter directory's config.json as a dict, or one line saying why it cannot be read, or that the directory
    holds a target model instead (:func:`target_model_config`): every reader of a DRAFT_DIR comes through here."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise EyasError(f"{path} is missing: a drafter directory holds config.json and model.safetensors")
    config = read_json_object(path, "replace it with the drafter's intact config")
    target = target_model_config(config)
    if target is not None:
        raise EyasError(f"{directory} is a target model, not a drafter: its config.json names {target}; give the "
                        "DRAFT_DIR that eyas export wrote from a run trained for this target (eyas train --target "
                        f"{directory}, then eyas export RUN_DIR --out DRAFT_DIR); {directory} itself goes to --target")
    return config


# parts of keys only a drafter's config.json holds (every family's: none is named here): a draft vocabulary, the eagle
# config and layer ids vLLM reads, the speculators format's nesting, a drafted block, the width of the target states
_DRAFTER_KEYS = ("draft", "eagle", "speculators", "block_size", "target_hidden_size")


def target_model_config(config: dict) -> str | None:
    """What marks a config.json as a target model's, or None: a causal LM (or multimodal) architecture, several decoder
    layers, and none of the keys a drafter's config has (:data:`_DRAFTER_KEYS`). A one-layer ``LlamaForCausalLM``
    without them (an EAGLE-1/2 release) is left to the family's reader, which names what it lacks."""
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not all(
            isinstance(name, str) and name.endswith(("ForCausalLM", "ForConditionalGeneration")) for name in names):
        return None
    if any(marker in key for key in config for marker in _DRAFTER_KEYS):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    layers = config.get("num_hidden_layers") or text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 2:
        return None
    return (f"architectures {names} with {layers} decoder layers, and no field of a drafter's (draft_vocab_size, "
            "eagle_config, speculators_config, block_size, target_hidden_size)")
