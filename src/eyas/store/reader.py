"""Read a FEATURES_DIR: a memory-mapped, map-style dataset of per-sample tensors.

Shards are opened with safetensors' ``safe_open`` (the file is memory-mapped) and only the rows
of the requested sample are read, so a terabyte store costs no RAM up front. fp8 stores are
dequantised on read, transparently.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from eyas.data.vocab import VOCAB_FILE
from eyas.errors import EyasError
from eyas.io import file_sha256
from eyas.manifest import MANIFEST, file_problem
from eyas.store import fp8
from eyas.store.shards import StoreManifest


def decode_stored(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
    """States in storage form ``values`` [..., W] (with their fp8 ``scale`` [..., k]) in ``dtype`` (None: as stored, fp8
    widened to bf16), where they are: one rule for a store's rows and a stream's (:mod:`eyas.train.stream`)."""
    if scale is not None:
        shape = values.shape
        flat = fp8.dequantize(values.reshape(-1, shape[-1]), scale.reshape(-1, scale.shape[-1]), dtype or torch.bfloat16)
        return flat.reshape(shape)
    return values if dtype is None else values.to(dtype)


class FeatureStore:
    """Samples of one split: ``store[i]`` → dict(id, input_ids, loss_mask, aux, final)."""

    def __init__(self, directory: Path, split: str = "train", dtype: torch.dtype | None = None):
        self.directory = Path(directory)
        self.manifest = StoreManifest.read(self.directory)
        if not self.manifest.complete:
            raise EyasError(f"{self.directory} is an unfinished capture; rerun the same eyas capture command to finish it")
        self.shards = [s for s in self.manifest.shards if s.split == split]
        self.layers = len(self.manifest.layer_ids)
        # fp8 is dequantised to bf16 by default; other stores come back as stored.
        self.dtype = dtype
        self._index: list[tuple[int, int]] = [(k, j) for k, shard in enumerate(self.shards) for j in range(len(shard.sample_ids))]
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._index)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each sample, in store order (from the shards' offsets, no state is read)."""
        return self.shard_lengths(range(len(self.shards)))

    def shard_lengths(self, shards) -> list[int]:
        """Tokens of each sample of the shards numbered ``shards`` (positions in this split), in that order."""
        out = []
        for k in shards:
            self._handle(k)
            out.extend((self._offsets[k][1:] - self._offsets[k][:-1]).tolist())
        return out

    @property
    def sample_ids(self) -> list[str]:
        """Ids in store order."""
        return [s for shard in self.shards for s in shard.sample_ids]

    def __getitem__(self, i: int) -> dict:
        item = self.stored(i)
        for name in ("aux", "final"):
            item[name] = self.decode(item[name], item.pop(f"{name}_scale", None))
        return item

    def stored(self, i: int) -> dict:
        """Sample ``i`` as the shard stores it (fp8 states with their ``aux_scale``/``final_scale``): what a loader
        moves to the GPU, where :meth:`decode` is nearly free, instead of widening it on the host first."""
        k, j = self._index[i]
        handle = self._handle(k)
        offsets = self._offsets[k]
        a, b = int(offsets[j]), int(offsets[j + 1])
        names = ("input_ids", "loss_mask", "aux", "final") + (("aux_scale", "final_scale") if self.manifest.dtype == "fp8" else ())
        return {"id": self.shards[k].sample_ids[j], **{name: handle.get_slice(name)[a:b] for name in names}}

    def decode(self, values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Stored states ``values`` [..., W] (with their fp8 ``scale`` [..., k]) in the store's read dtype, where they are."""
        return decode_stored(values, scale, self.dtype)

    def vocab_path(self) -> Path:
        """The draft vocabulary the store was captured with: the store's own copy, or — in a store made before stores
        carried one — DATA_DIR's, while DATA_DIR is still where the capture recorded it and unchanged."""
        record, own = self.manifest.output(VOCAB_FILE), self.directory / VOCAB_FILE
        if record is not None:
            problem = file_problem(own, record["bytes"], record["sha256"])
            if problem is not None:
                raise EyasError(f"{own}: {problem}; rerun the eyas capture command that made the store to restore it")
            return own
        if own.is_file():  # copied in by hand into an older store
            return own
        data_dir = Path(self.manifest.data["path"])
        if (data_dir / VOCAB_FILE).is_file() and (data_dir / MANIFEST).is_file() \
                and file_sha256(data_dir / MANIFEST) == self.manifest.data["manifest_sha256"]:
            return data_dir / VOCAB_FILE
        raise EyasError(
            f"{self.directory} holds no draft vocabulary (it was captured before stores carried one), and the DATA_DIR it "
            f"was captured from, {data_dir}, is gone or has changed: rerun the same eyas capture command with --data "
            f"DATA_DIR (it adds {VOCAB_FILE} to the finished store without capturing again), or copy that DATA_DIR's "
            f"{VOCAB_FILE} into {self.directory}")

    def _handle(self, k: int):
        if k not in self._handles:
            path = self.directory / self.shards[k].file
            handle = safe_open(str(path), framework="pt")
            self._handles[k] = handle
            self._offsets[k] = handle.get_tensor("offsets")
        return self._handles[k]
