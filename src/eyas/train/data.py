"""Training batches, offline (from FEATURES_DIR) or online (the target computes them on the fly).

Both sources cut the same samples into the same batches — length-sorted, packed to a token budget
(padding counted), each sample its own row so no sample attends to another, every batch as wide as its longest
row rounded up, on a GPU, to a multiple of ``SHAPE_MULTIPLE`` (:func:`batch_width`) — and both yield
the same tensors: ``aux`` [B, T, k·Ht], ``final`` [B, T, Ht], ``input_ids``, ``loss_mask``, ``valid``
[B, T]. The order of batches is a permutation fixed by (seed, epoch), so a resumed run sees
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eyas.data.samples import batch_inputs, pad_right
from eyas.store.plan import plan_shards


@dataclass
class Batch:
    """One training batch on the training device."""

    aux: torch.Tensor
    final: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    valid: torch.Tensor
    count: int | None = None  # real tokens, when the host knew them (reading valid back would wait for the GPU)

    @property
    def tokens(self) -> int:
        """Real tokens in the batch."""
        return self.count if self.count is not None else int(self.valid.sum())


# On a GPU, batch widths come in steps of this many tokens. Every new [rows, width] costs a GPU run more than its
# arithmetic: cuDNN's attention builds (and caches) an execution graph per shape, forward and backward, for each TTT
# step — tens to hundreds of milliseconds each (pytorch/pytorch#155958; sgl-project/sglang#4650 measured ~400 ms).
# Unrounded, a 16 k-conversation set cut at 32,768 tokens makes 559 shapes of 927 batches, most epoch-one batches a
# new one; rounded to 64 tokens (and planned so), 33 shapes of 940 batches for 2.1 % more padding. Padding is right
# of every real token, outside the loss and the attention's reach (each row attends causally to itself), so it
# changes no result. The CPU builds nothing per shape: there the padding would only cost, so widths are not rounded.
SHAPE_MULTIPLE = 64


def width_multiple(device: torch.device | str) -> int:
    """What batch widths are rounded to when training on ``device``: SHAPE_MULTIPLE on CUDA, 1 elsewhere."""
    return SHAPE_MULTIPLE if torch.device(device).type == "cuda" else 1


def batch_width(longest: int, multiple: int) -> int:
    """The width of a batch whose longest row has ``longest`` tokens: rounded up to a multiple of ``multiple``."""
    return -(-longest // multiple) * multiple


def plan_batches(lengths: list[int], token_budget: int, multiple: int = 1, max_batch: int = 64) -> list[tuple[int, ...]]:
    """Length-sorted batches of sample positions within the token budget, each row counted at its batch's width
    (rounded up to ``multiple``; the capture plan's rule over the rounded lengths)."""
    widths = [batch_width(n, multiple) for n in lengths]
    return [batch for shard in plan_shards(widths, token_budget, max_batch, 1 << 62) for batch in shard.batches]


def epoch_order(batches: int, seed: int, epoch: int) -> list[int]:
    """The batch order of one epoch: a permutation fixed by (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(batches, generator=generator).tolist()


def _pad_states(rows: list[torch.Tensor], width: int, pin: bool = False) -> torch.Tensor:
    out = torch.zeros(len(rows), width, rows[0].shape[-1], dtype=rows[0].dtype, pin_memory=pin)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


def _pin(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return tensor.pin_memory() if pin else tensor


class OfflineSource:
    """Batches read from a feature store (memory-mapped shards)."""

    def __init__(self, features: Path, split: str, token_budget: int, device: torch.device, dtype: torch.dtype,
                 multiple: int | None = None):
        from eyas.store.reader import FeatureStore

        self.store = FeatureStore(features, split, dtype=dtype)
        self.device, self.dtype = device, dtype
        self.multiple = width_multiple(device) if multiple is None else multiple
        ids = self.store.sample_ids
        lengths = self.store.lengths
        # Canonical order (by sample id) before planning: the online source plans the same batches.
        canonical = sorted(range(len(ids)), key=ids.__getitem__)
        self.ids = [ids[i] for i in canonical]
        self.lengths = [int(lengths[i]) for i in canonical]  # each sample's tokens, in this order
        plan = plan_batches(self.lengths, token_budget, self.multiple)
        self.batches = [tuple(canonical[j] for j in batch) for batch in plan]

    def batch(self, index: int) -> Batch:
        """Batch ``index`` of the plan."""
        return self.to_device(self.host_batch(index))

    def host_batch(self, index: int) -> dict[str, torch.Tensor]:
        """Batch ``index`` padded on the host in storage form (fp8 stays fp8), pinned when training on a GPU: the part
        of loading a :class:`Prefetcher` runs on its thread while the GPU trains."""
        return padded_host_batch([self.store.stored(i) for i in self.batches[index]], self.multiple,
                                 self.device.type == "cuda")

    def to_device(self, host: dict[str, torch.Tensor]) -> Batch:
        """A :meth:`host_batch` on the training device (asynchronous copies from pinned memory), decoded there."""
        return host_batch_to_device(host, self.device, self.dtype)


def padded_host_batch(items: list[dict], multiple: int, pin: bool) -> dict[str, torch.Tensor]:
    """Samples in storage form (each a dict of input_ids, loss_mask, aux, final [, aux_scale, final_scale]: a store's
    rows or a stream's) as one host batch: right-padded with zeros to the longest rounded up to ``multiple``, with its
    ``valid`` mask; pinned when ``pin``. One rule for every source that carries stored states."""
    width = batch_width(max(len(x["input_ids"]) for x in items), multiple)
    host = {name: _pad_states([x[name] for x in items], width, pin)
            for name in items[0] if name not in ("id", "input_ids", "loss_mask")}
    host["input_ids"] = _pin(pad_right([x["input_ids"].numpy() for x in items], torch.long, width), pin)
    host["loss_mask"] = _pin(pad_right([x["loss_mask"].numpy() for x in items], torch.uint8, width), pin)
    host["valid"] = _pin(pad_right([np.ones(len(x["input_ids"]), dtype=bool) for x in items], torch.bool, width), pin)
    return host


def host_batch_to_device(host: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Batch:
    """A :func:`padded_host_batch` on ``device`` (asynchronous copies from pinned memory), its states decoded there
    into ``dtype``."""
    from eyas.store.reader import decode_stored

    moved = {name: tensor.to(device, non_blocking=True) for name, tensor in host.items()}
    states = {name: decode_stored(moved[name], moved.get(f"{name}_scale"), dtype) for name in ("aux", "final")}
    return Batch(aux=states["aux"], final=states["final"], input_ids=moved["input_ids"], loss_mask=moved["loss_mask"],
                 valid=moved["valid"], count=int(host["valid"].sum()))


class Prefetcher:
    """Loads upcoming batches' host side on one thread while the device computes (``ahead``), so that reading shards
    is never what a GPU waits for; sources without a host side (online: the target computes them) load in ``batch``."""

    def __init__(self, source):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.source = source
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="eyas-prefetch") if hasattr(source, "host_batch") else None
        self.queue: deque = deque()  # (batch index, future), in the order they will be asked for
        self.waited = 0.0  # seconds the trainer waited for a prefetched batch (a slow disk, a stream's producer)

    def ahead(self, indices) -> None:
        """Start loading these batches, in this order, after those already queued."""
        if self.pool is not None:
            self.queue.extend((i, self.pool.submit(self.source.host_batch, i)) for i in indices)

    def batch(self, index: int) -> Batch:
        """Batch ``index``: the prefetched one when it is next in the queue, else loaded now."""
        if self.pool is None:
            return self.source.batch(index)
        if self.queue and self.queue[0][0] == index:
            began = time.perf_counter()
            host = self.queue.popleft()[1].result()
            self.waited += time.perf_counter() - began
            return self.source.to_device(host)
        return self.source.batch(index)

    def close(self) -> None:
        """Stop the thread (batches still queued are dropped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.queue.clear()


def planned_split(data_dir: Path, split: str, token_budget: int, multiple: int) -> tuple[list, list[tuple[int, ...]]]:
    """DATA_DIR's ``split`` in canonical order (by sample id) and its batches (:func:`plan_batches`): what every source
    that reads DATA_DIR trains on — online, and both ends of a stream (:mod:`eyas.train.stream`)."""
    from eyas.data.samples import read_samples

    return planned(read_samples(Path(data_dir) / f"{split}.parquet"), token_budget, multiple)


def planned(samples: list, token_budget: int, multiple: int) -> tuple[list, list[tuple[int, ...]]]:
    """``samples`` in canonical order (by sample id) and their batches (:func:`plan_batches`)."""
    samples = sorted(samples, key=lambda s: s.id)
    return samples, plan_batches([len(s.input_ids) for s in samples], token_budget, multiple)


class OnlineSource:
    """Batches whose target states are captured now, in this process: nothing touches the disk."""

    def __init__(self, target, data_dir: Path | None, split: str | None, layer_ids, token_budget: int, device, dtype,
                 multiple: int | None = None, compile_layers: bool = False, samples: list | None = None):
        """DATA_DIR's ``split``, or ``samples`` given here instead (planned the same way)."""
        self.target, self.layer_ids, self.compile_layers = target, tuple(layer_ids), compile_layers
        self.device, self.dtype = device, dtype
        self.multiple = width_multiple(device) if multiple is None else multiple
        self.samples, self.batches = planned_split(data_dir, split, token_budget, self.multiple) if samples is None \
            else planned(samples, token_budget, self.multiple)
        self.ids = [s.id for s in self.samples]
        self.lengths = [len(s.input_ids) for s in self.samples]  # each sample's tokens, in this order

    def batch(self, index: int) -> Batch:
        """Batch ``index`` of the plan, with states captured by the live target."""
        from eyas.target import capture_hidden_states

        rows = [self.samples[i] for i in self.batches[index]]
        width = batch_width(max(len(r.input_ids) for r in rows), self.multiple)
        input_ids, mask = batch_inputs(rows, width)
        valid = mask.bool()
        captured = capture_hidden_states(self.target.model, self.target.layout, input_ids, attention_mask=mask,
                                         layer_ids=self.layer_ids, offload=False, compile_layers=self.compile_layers)
        return Batch(
            aux=captured.aux.to(self.device, self.dtype),
            final=captured.final.to(self.device, self.dtype),
            input_ids=input_ids.to(self.device),
            loss_mask=pad_right([r.loss_mask for r in rows], torch.uint8, width).to(self.device),
            valid=valid.to(self.device),
            count=int(valid.sum()),
        )


def batches_forever(source, seed: int, start_epoch: int = 0, start_index: int = 0) -> Iterator[tuple[int, int, int]]:
    """(epoch, position in epoch, batch index) from a data position onwards, epoch after epoch.
    Batches are not loaded here: under torchrun each rank loads only its own."""
    epoch, index = start_epoch, start_index
    while True:
        order = epoch_order(len(source.batches), seed, epoch)
        while index < len(order):
            yield epoch, index, order[index]
            index += 1
        epoch, index = epoch + 1, 0


def batch_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of the batch at (epoch, index) of a run seeded ``seed``: what a family draws at random for a batch (a
    block drafter's anchors) is drawn from it, so a resumed run draws what an uninterrupted one would."""
    return (seed * 1_000_003 + epoch * 65_537 + index) % (2**63)
