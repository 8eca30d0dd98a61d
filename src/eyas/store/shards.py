"""Shard files and the manifest that lists them.

A shard packs many samples end to end: ``input_ids`` int32 [ΣT], ``loss_mask`` uint8 [ΣT],
``aux`` [ΣT, k·H], ``final`` [ΣT, H] and ``offsets`` int64 [n+1] (sample i is rows
offsets[i]:offsets[i+1]). With fp8 storage ``aux``/``final`` are e4m3 and ``aux_scale`` [ΣT, k],
``final_scale`` [ΣT, 1] hold the float32 scales. Shards are written under a temporary name,
fsynced and renamed, so a shard file that exists is complete; its SHA-256 goes in the manifest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save

from eyas.io import atomic_path, write_json_atomic
from eyas.store import fp8

STORE_FORMAT = "eyas-features/1"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclass
class ShardRecord:
    """A finished shard as the manifest lists it."""

    file: str
    split: str
    index: int
    sample_ids: list[str]
    tokens: int
    bytes: int
    sha256: str


@dataclass
class StoreManifest:
    """What a FEATURES_DIR holds and how it was made (``manifest.json``)."""

    target: dict  # spec, source, config sha256, architecture, num_layers, hidden_size
    data: dict  # DATA_DIR path and its manifest sha256
    layer_ids: list[int]
    layer_id_convention: str
    dtype: str
    options: dict
    shards: list[ShardRecord] = field(default_factory=list)
    complete: bool = False
    format: str = STORE_FORMAT

    def identity(self) -> dict:
        """The fields that must match for a rerun to continue this store."""
        return {"target": self.target, "data": self.data, "layer_ids": self.layer_ids, "dtype": self.dtype, "options": self.options}

    def save(self, path: Path) -> None:
        """Replace ``path`` atomically."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> StoreManifest:
        """Read a manifest written by :meth:`save`."""
        data = json.loads(Path(path).read_text())
        data["shards"] = [ShardRecord(**s) for s in data.get("shards", [])]
        return cls(**data)


def shard_name(split: str, index: int) -> str:
    """File name of shard ``index`` of ``split`` (independent of which rank wrote it)."""
    return f"{split}-{index:05d}.safetensors"


def write_shard(path: Path, samples: list[dict[str, torch.Tensor]], dtype: str, layers: int) -> tuple[int, str]:
    """Pack ``samples`` (input_ids, loss_mask, aux, final) into one shard; return (bytes, sha256)."""
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    aux = torch.cat([s["aux"] for s in samples])
    final = torch.cat([s["final"] for s in samples])
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
        "offsets": offsets,
    }
    if dtype == "fp8":
        tensors["aux"], tensors["aux_scale"] = fp8.quantize(aux, layers)
        tensors["final"], tensors["final_scale"] = fp8.quantize(final, 1)
    else:
        tensors["aux"], tensors["final"] = aux.to(DTYPES[dtype]), final.to(DTYPES[dtype])
    # Serialise in memory once: hash those bytes and write them, instead of reading the file back.
    blob = save({k: v.contiguous() for k, v in tensors.items()})
    digest = hashlib.sha256(blob).hexdigest()
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(blob)
    return len(blob), digest


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def bytes_per_token(hidden_size: int, layers: int, dtype: str) -> int:
    """Stored bytes per token: aux + final states, scales, token id and mask."""
    states = (layers + 1) * hidden_size
    if dtype == "fp8":
        return states + 4 * (layers + 1) + 5
    return states * torch.finfo(DTYPES[dtype]).bits // 8 + 5
