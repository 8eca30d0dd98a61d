"""Batched greedy or sampled decoding over an HF causal LM, for regeneration: one prefill, then fixed-shape steps.

transformers' ``generate`` over a compiled static cache spends minutes compiling each shape, and an eager step
of a small target is launch-bound (the demo target: ~12 ms per step at batch 256 on an H200, whose weights read
in 60 µs). Here a batch runs as:

1. prefill: the prompts left-padded to one width, an attention mask hiding the padding and position ids as
   transformers computes them for left padding (a row's first real token is position 0), written into a
   :class:`eyas.engine.kv.SlotCache` at slots [0, width); eager forwards of a few rows each (at most
   ``prefill_tokens`` padded tokens: a whole batch of long prompts at once needs tens of GB for its masks and
   activations), each forward padded only to its own longest prompt and written right-aligned (its slots
   [width − its width, width), the slots before it hidden from its rows), last position's logits only;
2. decoding: every row writes its next token at the same slot (width + step), so every step of a batch has
   the same shapes: ids [B, 1], positions [B, 1], the slot, and a mask over the first ``visible`` slots (the
   cache's length rounded up to a block, so early steps do not read the whole cache). On CUDA each step is one
   CUDA-graph replay (:class:`eyas.engine.graphs.StepGraphs`, recorded once per (batch, capacity, visible,
   sampled) — no torch.compile); elsewhere the same step runs eagerly;
3. a row stops at its first stop id; the batch stops when every row has (checked every few steps, so the
   host rarely waits for the device) or at ``max_new_tokens``.

Batches are filled to a power of two (at most ``max_batch``) with copies of their last prompt (their answers dropped), so few shapes
exist. Sampling (T > 0) draws each token by inverse CDF from one uniform per row, hashed from the row's seed and
the step on the device: a row's random stream depends only on its seed (:func:`row_seed`: the run's seed and
the prompt), not on the batch it shares or its place in it. Its logits can still differ in the last bits
between batch shapes on a GPU, so a token that lands on a near-tie can differ; on the CPU they agree.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eyas.engine.attention import layer_masks, sliding_rule
from eyas.engine.graphs import StepGraphs
from eyas.engine.grouped_attention import grouped_attention
from eyas.engine.kv import SlotCache
from eyas.sampling import draw, sampling_probs
from eyas.target.compat import cache_keyword
from eyas.target.layout import text_config

_MASK32 = 0xFFFFFFFF
_LANES = 2  # batch sizes whose caches are kept at once (the full batches and a chunk's last, smaller ones)


@dataclass
class DecodeStats:
    """What the decoder did so far; seconds are measured with the device synchronised at phase ends."""

    batches: int = 0
    steps: int = 0  # decoding forwards after the prefills, summed over batches
    rows: int = 0  # prompts answered (filler rows not counted)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # the steps, recordings included
    record_s: float = 0.0  # of decode_s: steps that recorded a CUDA graph (warm-ups and capture)
    graphs: int = 0  # CUDA graphs recorded


def row_seed(seed: int, prompt: Sequence[int]) -> int:
    """A row's 32-bit sampling seed from the run's seed and the prompt's token ids: the same prompt samples the
    same answer in any batch, at any place, on a resumed run."""
    digest = hashlib.sha256(f"{seed}:{','.join(map(str, prompt))}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of int64 values in [0, 2³²): every product stays below 2⁶³."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, float64 [B], from int64 ``seeds`` [B] and the step [1] (device tensors)."""
    x = _mix(seeds ^ _mix((step + 0x632BE5AB) & _MASK32))
    x = _mix(x ^ 0x5BD1E995)
    return ((x >> 8).double() + 0.5) / float(1 << 24)


def pick(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Next token per row [B] from logits [B, V]: argmax when ``temperature`` is None, else a draw from
    softmax(logits / T) by inverse CDF with the row's uniform (no host synchronisation: graph-safe)."""
    if temperature is None:
        return logits.argmax(-1)
    return draw(sampling_probs(logits, temperature), uniforms(seeds, step))


class _Lane:
    """The buffers of one batch size: its cache and every input a recorded step reads."""

    def __init__(self, batch: int, capacity: int, layers: int, device: torch.device):
        self.batch, self.capacity = batch, capacity
        self.cache = SlotCache(layers, capacity)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # key slots a row may see
        self.seeds = torch.zeros(batch, dtype=torch.long, device=device)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.index = torch.arange(capacity, device=device)


class BatchedDecoder:
    """Greedy or sampled decoding of batches of token-id prompts over ``model`` (any HF decoder with sdpa or
    eager attention); ``graphs``: replay decoding steps from CUDA graphs on CUDA; ``block``: the granularity of
    cache capacities and of the visible window; ``sync_every``: steps between the host's looks at whether every
    row has stopped; ``prefill_tokens``: padded prompt tokens per prefill forward."""

    def __init__(self, model: nn.Module, stop_ids: Sequence[int], pad_id: int, graphs: bool = True, block: int = 256,
                 sync_every: int = 8, max_batch: int = 1, prefill_tokens: int = 65536):
        self.model, self.pad_id, self.block, self.sync_every = model, pad_id, block, max(1, sync_every)
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward
        self.max_batch = max_batch  # batches are filled to a power of two, but never beyond this (or their own size)
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        config = text_config(model.config)
        self.layers = int(config.num_hidden_layers)
        self.window, self.window_everywhere = sliding_rule(config)
        self._stop_set = set(stop_ids)
        self.stops = torch.tensor(sorted(self._stop_set) or [-1], dtype=torch.long, device=self.device)
        # out of memory while recording propagates: the caller retries smaller batches, with graphs still on
        self.graphs = StepGraphs(self.device, enabled=graphs, name="a regeneration decoding step",
                                 raises=(torch.cuda.OutOfMemoryError,))
        self.stats = DecodeStats()
        self._lanes: OrderedDict[int, _Lane] = OrderedDict()
        self._cache_kwarg = cache_keyword(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @torch.inference_mode()
    def decode(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
               seeds: Sequence[int] | None = None) -> list[list[int]]:
        """New token ids per prompt, in order: up to and including the row's first stop id, at most
        ``max_new_tokens`` (a row without a stop id ran out: truncated). ``seeds``: one per prompt (T > 0)."""
        count = len(prompts)
        if count == 0:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        batch = max(count, min(1 << (count - 1).bit_length(), self.max_batch))
        rows = [list(p) for p in prompts] + [list(prompts[-1])] * (batch - count)
        row_seeds = list(seeds) if seeds is not None else [0] * count
        row_seeds += [row_seeds[-1]] * (batch - count)
        width = max(len(r) for r in rows)
        lane = self._lane(batch, -(-(width + max_new_tokens) // self.block) * self.block)
        lane.seeds.copy_(torch.tensor(row_seeds, dtype=torch.long))
        lane.temperature.fill_(max(temperature, 1e-6))
        sampled = temperature > 0

        with grouped_attention(self.model):  # one-token steps read each key head once, not once per query head
            started = self._clock()
            token = self._prefill(lane, rows, width, sampled)
            self.stats.prefill_s += self._clock() - started
            out = torch.empty(batch, max_new_tokens, dtype=torch.long, device=self.device)
            done = torch.zeros(batch, dtype=torch.bool, device=self.device)
            done[count:] = True  # filler rows never keep a batch running
            started, steps = self._clock(), 0
            for k in range(max_new_tokens):
                out[:, k] = token
                done |= torch.isin(token, self.stops)
                produced = k + 1
                if produced == max_new_tokens or (produced % self.sync_every == 0 and bool(done.all())):
                    break
                lane.ids.copy_(token[:, None])
                token = self._step(lane, width + k, sampled)
                lane.positions += 1
                lane.slot += 1
                lane.step += 1
                steps += 1
            self.stats.decode_s += self._clock() - started
        self.stats.steps += steps
        self.stats.batches += 1
        self.stats.rows += count
        return [self._cut(row[:produced]) for row in out[:count].tolist()]

    def _cut(self, tokens: list[int]) -> list[int]:
        """A row's tokens up to and including its first stop id (what it produced after stopping is dropped)."""
        end = next((k + 1 for k, t in enumerate(tokens) if t in self._stop_set), len(tokens))
        return tokens[:end]

    def release(self) -> None:
        """Free every cache and recording (after running out of memory: the next batches start from nothing)."""
        self.graphs.drop(lambda key: True)
        self._lanes.clear()

    def _lane(self, batch: int, capacity: int) -> _Lane:
        """The buffers for ``batch`` rows with room for ``capacity`` slots: reused when large enough (its graphs
        stay valid), else rebuilt (its graphs dropped); the least recently used lanes beyond a few are freed."""
        lane = self._lanes.pop(batch, None)
        if lane is None or lane.capacity < capacity:
            self.graphs.drop(lambda key: key[0] == batch)
            del lane  # its cache is freed before the larger one is allocated
            lane = _Lane(batch, capacity, self.layers, self.device)
        self._lanes[batch] = lane
        while len(self._lanes) > _LANES:
            old, _ = self._lanes.popitem(last=False)
            self.graphs.drop(lambda key, old=old: key[0] == old)
        return lane

    def _prefill(self, lane: _Lane, rows: list[list[int]], width: int, sampled: bool) -> torch.Tensor:
        """Run the left-padded prompts into slots [0, width) → each row's first new token [B]."""
        ids = torch.full((lane.batch, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((lane.batch, width), dtype=torch.bool)
        for n, row in enumerate(rows):
            ids[n, width - len(row):] = torch.tensor(row, dtype=torch.long)
            real[n, width - len(row):] = True
        real = real.to(self.device)
        # transformers' positions for left padding: the first real token is 0 (padding gets 1, unseen by real rows)
        positions = (real.long().cumsum(-1) - 1).masked_fill_(~real, 1)
        lane.valid.fill_(True)
        lane.valid[:, :width] = real
        extra = {"logits_to_keep": 1} if self._keeps_logits else {}
        lane.step.zero_()
        first = torch.empty(lane.batch, dtype=torch.long, device=self.device)
        for start, end, span in self._prefill_forwards([len(r) for r in rows]):
            # rows [start, end) as wide as their longest (span): their slots [width − span, width) of the lane's cache
            offset = width - span
            index = lane.index[:span]
            causal = index[None, :] <= index[:, None]
            # a padding query sees itself, so that no row of the mask is empty (an all-masked row would give NaNs)
            itself = torch.eye(span, dtype=torch.bool, device=self.device)[None]
            near = None if self.window is None else (index[:, None] - index[None, :]) < self.window
            part = SlotCache(self.layers, span)
            part.slots, part.visible = index, span
            seen = (causal[None] & real[start:end, None, offset:]) | itself
            logits = self._forward(part, ids[start:end, offset:].to(self.device), positions[start:end, offset:],
                                   layer_masks(seen, near, self.window_everywhere, self.dtype), **extra)
            lane.cache.put_rows(part, start, lane.batch, offset)
            del part
            first[start:end] = pick(logits[:, -1], lane.temperature if sampled else None, lane.seeds[start:end], lane.step)
        lane.positions.copy_(positions[:, -1:] + 1)
        lane.slot.fill_(width)
        return first

    def _prefill_forwards(self, lengths: list[int]) -> list[tuple[int, int, int]]:
        """(start, end, span) per prefill forward: consecutive rows while their count × the longest of them stays
        within ``prefill_tokens`` (one row at least), each forward as wide as its own longest prompt — a batch of
        prompts sorted longest first pads each forward to its own rows, not to the batch's longest."""
        forwards, start = [], 0
        while start < len(lengths):
            end, span = start + 1, lengths[start]
            while end < len(lengths) and (end + 1 - start) * max(span, lengths[end]) <= self.prefill_tokens:
                span = max(span, lengths[end])
                end += 1
            forwards.append((start, end, span))
            start = end
        return forwards

    def _step(self, lane: _Lane, slot: int, sampled: bool) -> torch.Tensor:
        """One decoding step of the whole batch at cache slot ``slot`` (the host's copy of ``lane.slot``)."""
        visible = min(lane.capacity, -(-(slot + 1) // self.block) * self.block)
        key = (lane.batch, lane.capacity, visible, sampled)

        def step() -> torch.Tensor:
            lane.cache.slots, lane.cache.visible = lane.slot, visible
            index = lane.index[:visible]
            seen = (lane.valid[:, :visible] & (index <= lane.slot))[:, None, :]  # [B, 1, visible]
            near = None if self.window is None else (lane.slot - index < self.window)[None, None, :]
            logits = self._forward(lane.cache, lane.ids, lane.positions, layer_masks(seen, near, self.window_everywhere,
                                                                               self.dtype))
            return pick(logits[:, -1], lane.temperature if sampled else None, lane.seeds, lane.step)

        if self.graphs.enabled and not self.graphs.has(key):
            started, before = self._clock(), len(self.graphs)
            token = self.graphs.run(key, step)
            self.stats.record_s += self._clock() - started
            self.stats.graphs += len(self.graphs) - before
            return token
        return self.graphs.run(key, step)

    def _forward(self, cache: SlotCache, ids: torch.Tensor, positions: torch.Tensor, mask, **extra) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         **{self._cache_kwarg: cache}, **extra)
        return out.logits

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
