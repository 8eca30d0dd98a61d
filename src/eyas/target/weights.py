"""Read single tensors of a target's checkpoint (its final norm, lm_head, embedding) without loading it.

A trainer needs the target's lm_head (the teacher) and token embedding; vLLM capture needs its final
norm. For a 600 B-parameter target, loading the model for that is not an option: these functions
find each tensor's file through the safetensors index and read only that tensor.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from eyas.errors import EyasError
from eyas.target.layout import discover_layout, text_config
from eyas.target.loading import build_skeleton, load_target_config


def load_final_norm(target_source: str, num_layers: int | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The target's final norm with its checkpoint weights, without loading anything else."""
    config, source = load_target_config(target_source, trust_remote_code)
    layout = discover_layout(build_skeleton(config, trust_remote_code))  # meta device: no memory
    if num_layers is not None and layout.num_layers != num_layers:
        raise EyasError(f"target {target_source!r} has {layout.num_layers} decoder layers, not {num_layers}")
    return load_submodule(source, layout.norm, layout.norm_path).eval()


def load_submodule(source: str, module: nn.Module, path: str) -> nn.Module:
    """Fill a (meta-device) submodule of the target with its checkpoint tensors, read alone."""
    wanted = {name: f"{path}.{name}" for name in module.state_dict()}
    module.load_state_dict(checkpoint_tensors(source, wanted), strict=True, assign=True)
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise EyasError(f"{path} has tensors the checkpoint does not hold: {left}")
    return module


def head_and_embedding(target_source: str, trust_remote_code: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's lm_head weight [V, Ht] and token embedding [V, Ht], read alone from the checkpoint
    (tied models store the embedding only; it is then both)."""
    config, source = load_target_config(target_source, trust_remote_code)
    layout = discover_layout(build_skeleton(config, trust_remote_code))
    embed = checkpoint_tensors(source, {"w": f"{layout.embed_path}.weight"})["w"]
    try:
        head = checkpoint_tensors(source, {"w": f"{layout.lm_head_path}.weight"})["w"]
    except EyasError:
        if not getattr(config, "tie_word_embeddings", False) and not getattr(text_config(config), "tie_word_embeddings", False):
            raise
        head = embed
    return head, embed


def weights_sha256(target_source: str, trust_remote_code: bool = False) -> str | None:
    """SHA-256 of the target's token embedding, lm_head and final norm as its checkpoint stores them: what tells apart
    two targets of one config (another fine-tune, a base model and its instruct sibling) without reading every weight.
    None when the checkpoint cannot be read tensor by tensor (not safetensors)."""
    config, source = load_target_config(target_source, trust_remote_code)
    layout = discover_layout(build_skeleton(config, trust_remote_code))
    wanted = {"embed": f"{layout.embed_path}.weight", "lm_head": f"{layout.lm_head_path}.weight",
              **{f"norm.{name}": f"{layout.norm_path}.{name}" for name in layout.norm.state_dict()}}
    digest = hashlib.sha256()
    for local, path in wanted.items():  # one tensor in memory at a time
        try:
            tensor = checkpoint_tensors(source, {local: path})[local]
        except (EyasError, OSError):
            if local == "lm_head":  # tied to the embedding, which is hashed already
                continue
            return None
        digest.update(f"{local} {tensor.dtype} {list(tensor.shape)}".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def checkpoint_files(target_source: str, trust_remote_code: bool = False) -> list[Path] | None:
    """The safetensors files of the target's checkpoint (every shard the index names, or model.safetensors); None when
    the checkpoint is not safetensors."""
    _, source = load_target_config(target_source, trust_remote_code)
    try:
        names = sorted(set(_checkpoint_keys(source).values()))
    except EyasError:
        return None
    return [_checkpoint_file(source, name) for name in names]


def checkpoint_tensors(source: str, wanted: dict[str, str]) -> dict[str, torch.Tensor]:
    """Read the tensors named ``wanted`` (local name → module path) from the safetensors checkpoint."""
    from safetensors import safe_open

    located = _checkpoint_keys(source)
    out = {}
    for local, path in wanted.items():
        key = _match_key(path, located)
        with safe_open(str(_checkpoint_file(source, located[key])), framework="pt") as f:
            out[local] = f.get_tensor(key)
    return out


def _checkpoint_keys(source: str) -> dict[str, str]:
    """Every tensor name of the checkpoint → the file holding it (sharded or single-file)."""
    from safetensors import safe_open

    index = _checkpoint_file(source, "model.safetensors.index.json", required=False)
    if index is not None:
        return dict(json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"])
    single = _checkpoint_file(source, "model.safetensors", required=False)
    if single is None:
        raise EyasError(
            f"target {source!r} has neither model.safetensors nor model.safetensors.index.json; "
            "single tensors are read from safetensors checkpoints only"
        )
    with safe_open(str(single), framework="pt") as f:
        return {key: "model.safetensors" for key in f.keys()}


def _checkpoint_file(source: str, name: str, required: bool = True) -> Path | None:
    """A file of the checkpoint: from the directory, or fetched alone from the hub."""
    if Path(source).is_dir():
        path = Path(source) / name
        if path.exists() or not required:
            return path if path.exists() else None
        raise EyasError(f"{path} is listed by the checkpoint index but does not exist")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(source, name))
    except EntryNotFoundError:
        if required:
            raise
        return None


def _match_key(path: str, keys: dict[str, str]) -> str:
    """The checkpoint name of module tensor ``path``; when the module tree and checkpoint names
    differ (multimodal wrappers), the one tensor with the same leaf that is not inside a stack."""
    if path in keys:
        return path
    leaf = ".".join(path.split(".")[-2:])  # e.g. "norm.weight"
    found = [k for k in keys if (k == leaf or k.endswith("." + leaf)) and ".layers." not in k and ".blocks." not in k]
    if len(found) == 1:
        return found[0]
    raise EyasError(
        f"cannot find the tensor {path!r} in the checkpoint; "
        + (f"candidates: {found[:10]}" if found else f"no tensor name ends in {leaf!r}")
    )
