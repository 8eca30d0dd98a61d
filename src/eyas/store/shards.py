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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.io import atomic_path, write_json_atomic
from eyas.manifest import FORMATS, MANIFEST, read_stage_manifest
from eyas.store import fp8

STORE_FORMAT = FORMATS["capture"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
# What decides the shards' contents: a rerun continues a store only when these match. By content, never by place:
# DATA_DIR counts by its manifest's SHA-256, so a moved DATA_DIR resumes.
IDENTITY_TARGET = ("spec", "config_sha256", "architecture", "num_layers", "hidden_size")
IDENTITY_OPTIONS = ("token_budget", "max_batch", "shard_mb", "splits", "max_gb", "engine", "compile_layers")
# what a store made before an identity option existed was captured with: its rerun continues it only that way
_BEFORE_THE_OPTION = {"compile_layers": False}  # the HF forward as it is, before --compile-layers (0609c3e)


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
    """What a FEATURES_DIR holds and how it was made (``manifest.json``): the stage manifest's common fields
    (:mod:`eyas.manifest`) and the store's own."""

    target: dict  # eyas.target.facts.target_facts: spec, source, config sha256, architecture, model type, N, H, V
    data: dict  # DATA_DIR: the path captured from, and its manifest's sha256 (what identifies it)
    layer_ids: list[int]
    layer_id_convention: str
    dtype: str
    options: dict  # the capture's options
    shards: list[ShardRecord] = field(default_factory=list)
    complete: bool = False
    vllm_engine: dict | None = None  # engine vllm: every LLM(...) argument the worker used and the defaults it chose
    format: str = STORE_FORMAT
    stage: str = "capture"
    eyas_version: str | None = None  # this field and the next ones: None in stores made before they existed
    git_commit: str | None = None
    created: str | None = None
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)  # files besides the shards: the draft vocabulary
    compute_dtype: str | None = None  # the dtype the target's forward ran in (float32, bfloat16, …), as captured

    def identity(self) -> dict:
        """The fields that must match for a rerun to continue this store."""
        return {"target": {k: self.target.get(k) for k in IDENTITY_TARGET}, "data": self.data.get("manifest_sha256"),
                "layer_ids": self.layer_ids, "dtype": self.dtype, "options": {k: self.options.get(k, _BEFORE_THE_OPTION.get(k)) for k in IDENTITY_OPTIONS}}

    def output(self, name: str) -> dict | None:
        """The record of output file ``name`` (bytes, sha256), or None when the store lists none."""
        return next((record for record in self.outputs if record["file"] == name), None)

    def save(self, path: Path) -> None:
        """Replace ``path`` atomically."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> StoreManifest:
        """Read a manifest written by :meth:`save` (fields a newer eyas added are ignored)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def read(cls, directory: Path) -> StoreManifest:
        """FEATURES_DIR's manifest.json, or an error naming it and what to do (missing, damaged, not a store's)."""
        damaged = "the FEATURES_DIR is damaged; rerun the eyas capture command that made it"
        try:
            manifest = cls.from_dict(read_stage_manifest(directory, "capture"))
        except (TypeError, KeyError, AttributeError) as err:  # fields missing or of the wrong kind
            raise EyasError(f"{Path(directory) / MANIFEST} lacks what a store's manifest holds ({type(err).__name__}: "
                            f"{err}): {damaged}") from None
        problem = manifest.shape_problem()
        if problem is not None:
            raise EyasError(f"{Path(directory) / MANIFEST}: {problem}: {damaged}")
        return manifest

    def shape_problem(self) -> str | None:
        """What in the manifest is of the wrong kind (a field every reader trusts: the target's facts, the layer ids,
        the dtype, the options, each shard's record), or None."""
        if not isinstance(self.target, dict) or not isinstance(self.data, dict) or not isinstance(self.options, dict):
            return "target, data and options must be JSON objects"
        layers = self.target.get("num_layers")
        ids = self.layer_ids
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids) or ids != sorted(set(ids)) \
                or ids[0] < 0 or (type(layers) is int and ids[-1] > layers):
            return f"layer_ids {ids!r} are not increasing layer ids of a {layers}-layer target"
        if self.dtype not in DTYPES:
            return f"dtype {self.dtype!r} is none of {', '.join(DTYPES)}"
        if not isinstance(self.options.get("splits", []), list):
            return f"options.splits {self.options.get('splits')!r} is not a list"
        kinds = {"file": str, "split": str, "index": int, "sample_ids": list, "tokens": int, "bytes": int, "sha256": str}
        for shard in self.shards:
            wrong = [name for name, kind in kinds.items() if not isinstance(getattr(shard, name), kind)]
            if wrong:
                return f"the record of shard {shard.file!r} has {', '.join(wrong)} of the wrong kind"
        return None

    @classmethod
    def from_dict(cls, data: dict) -> StoreManifest:
        """A manifest from its JSON form."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["shards"] = [ShardRecord(**{k: s[k] for k in ShardRecord.__dataclass_fields__}) for s in data.get("shards", [])]
        return cls(**data)


def shard_name(split: str, index: int) -> str:
    """File name of shard ``index`` of ``split`` (independent of which rank wrote it)."""
    return f"{split}-{index:05d}.safetensors"


@dataclass
class Pack:
    """Consecutive samples' rows in storage form (cast or quantised), maybe still being copied to the host."""

    lengths: list[int]
    tensors: dict[str, torch.Tensor]  # input_ids, loss_mask, aux, final [, aux_scale, final_scale]
    ready: object | None = None  # a CUDA event set once the host copies are complete
    compute_dtype: str = "float32"  # the states' dtype before storage: the forward's (torch name)

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens in the pack."""
        return sum(self.lengths)


_copy_streams: dict = {}


def pack_states(
    input_ids: list[np.ndarray], loss_masks: list[np.ndarray], aux: torch.Tensor, final: torch.Tensor, dtype: str, layers: int
) -> Pack:
    """Turn per-token states ``aux`` [ΣT, k·H] and ``final`` [ΣT, H] into a Pack in storage form.

    Casting or fp8 quantisation runs where the states are (on the GPU it is nearly free); from a
    GPU the results go to pinned host memory with non-blocking copies on a side stream, so the next
    forward starts at once and the writer waits only for this pack's own copies.
    """
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate(input_ids).astype(np.int32, copy=False)),
        "loss_mask": torch.from_numpy(np.concatenate(loss_masks).astype(np.uint8, copy=False)),
    }
    if dtype == "fp8":
        tensors["aux"], tensors["aux_scale"] = fp8.quantize(aux, layers)
        tensors["final"], tensors["final_scale"] = fp8.quantize(final, 1)
    else:
        tensors["aux"], tensors["final"] = aux.to(DTYPES[dtype]), final.to(DTYPES[dtype])
    pack = Pack([len(x) for x in input_ids], tensors, compute_dtype=str(aux.dtype).removeprefix("torch."))
    if aux.device.type == "cuda":
        device = aux.device
        stream = _copy_streams.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for name in ("aux", "final", "aux_scale", "final_scale"):
                if name in tensors:
                    on_device = tensors[name]
                    host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
                    host.copy_(on_device, non_blocking=True)
                    on_device.record_stream(stream)
                    tensors[name] = host
            pack.ready = stream.record_event()
    return pack


# safetensors dtype names of the tensors a shard holds
_ST_DTYPE = {torch.int32: "I32", torch.uint8: "U8", torch.int64: "I64", torch.float32: "F32", torch.bfloat16: "BF16",
             torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}


def write_shard(path: Path, packs: list[Pack]) -> tuple[int, str]:
    """Stream the packs into one safetensors shard; return (bytes, sha256).

    Written by hand (an 8-byte header length, a JSON header, then each tensor's bytes) so the
    pieces go from their buffers straight to the file and into the hash — no concatenated copy,
    no serialised copy. Readers are plain safetensors.
    """
    for pack in packs:
        if pack.ready is not None:
            pack.ready.synchronize()
    lengths = [n for pack in packs for n in pack.lengths]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    names = ["input_ids", "loss_mask", "offsets", "aux", "final"] + [n for n in ("aux_scale", "final_scale") if n in packs[0].tensors]
    parts = {name: [offsets] if name == "offsets" else [pack.tensors[name].contiguous() for pack in packs] for name in names}
    header, cursor = {}, 0
    for name in names:
        pieces = parts[name]
        nbytes = sum(t.numel() * t.element_size() for t in pieces)
        shape = [sum(t.shape[0] for t in pieces), *pieces[0].shape[1:]]
        header[name] = {"dtype": _ST_DTYPE[pieces[0].dtype], "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            digest.update(chunk)
        for name in names:
            for piece in parts[name]:
                view = memoryview(piece.reshape(-1).view(torch.uint8).numpy())
                f.write(view)  # releases the GIL, as does the hash update: writers run in parallel
                digest.update(view)
    return 8 + len(head) + cursor, digest.hexdigest()


def bytes_per_token(hidden_size: int, layers: int, dtype: str) -> int:
    """Stored bytes per token: aux + final states, scales, token id and mask."""
    states = (layers + 1) * hidden_size
    if dtype == "fp8":
        return states + 4 * (layers + 1) + 5
    return states * torch.finfo(DTYPES[dtype]).bits // 8 + 5
