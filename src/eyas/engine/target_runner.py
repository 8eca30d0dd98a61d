"""The target side of speculative decoding: forwards over a slot cache, with the EAGLE-3 aux states.

Committed tokens occupy cache slots [0, length); a forward writes its n tokens at [length, length+n) and
sees every committed slot plus the new ones its mask allows (a tree's nodes: their ancestors). A
decoding step (:meth:`TargetRunner.verify`) takes the committed length as a device tensor and attends
over the cache (the GPU's kernels stop at the filled slots), its mask built on the device: every step of n tokens has the same shapes and
addresses, which is what a CUDA graph needs, and the host never waits for it. The accepted tokens of
a tree are then copied down to the slots after the committed ones (:meth:`TargetRunner.move_slots`).

The aux states come from :class:`eyas.target.taps.Taps`, the one tap rule capture uses too: pre-hooks
that must fire exactly once per forward of the HF forward (a compiled or graph-replayed model that
skips them is refused rather than drafting from stale states), or the fused Llama forward's direct
writes (:mod:`eyas.engine.fused_llama`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import torch
from torch import nn

from eyas.engine.attention import layer_masks, sliding_rule
from eyas.engine.causal_prefill import causal_prefill, no_mask, serves
from eyas.engine.fused_llama import FusedLlamaForward, fused_support
from eyas.engine.graphs import InputBuffer, StepGraphs
from eyas.engine.kv import SlotCache
from eyas.errors import CaptureError, EyasError
from eyas.target.compat import cache_keyword
from eyas.target.layout import TargetLayout, text_config
from eyas.target.taps import Taps

log = logging.getLogger(__name__)


class TargetRunner:
    """An HF causal LM behind a :class:`SlotCache` of ``capacity`` tokens (batch 1)."""

    # with graphs, a prompt padded up to one of these lengths replays that length's recorded prefill; longer ones
    # run eagerly, where launches no longer dominate (and a recording's mask would grow with length × capacity)
    PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)

    def __init__(self, model: nn.Module, layout: TargetLayout, layer_ids: Sequence[int] | None, capacity: int,
                 graphs: bool = False, compile: bool = False, lean: bool = True):
        """``graphs``: on CUDA, decoding rounds (:mod:`eyas.engine.round`) and prefills replay CUDA graphs
        (:mod:`eyas.engine.graphs`); ``compile``: rounds are fused by ``torch.compile`` first. A target whose
        forward cannot be recorded (data-dependent MoE routing on the host, say) falls back to eager forwards
        with a warning. ``lean``: a Llama-family target's decoding steps take :mod:`eyas.engine.fused_llama`'s
        path (fused projections, aux states written without hooks); prefills always run the HF forward."""
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in ("sdpa", "eager"):
            raise EyasError(f"the engine needs sdpa or eager attention (it passes tree masks); the target uses {attention!r}: "
                            "load it with attn_implementation='sdpa'")
        self.model, self.layout, self.capacity = model, layout, capacity
        self.taps = Taps(layer_ids, layout.num_layers)
        self.layer_ids = self.taps.layer_ids
        self.device = layout.embed.weight.device
        self.dtype = layout.embed.weight.dtype
        config = text_config(model.config)
        self.sliding_window, self.sliding_everywhere = sliding_rule(config)
        self.cache = SlotCache(int(config.num_hidden_layers), capacity)
        self.length = 0  # committed tokens, as the host last saw them (rounds keep the device's count)
        # position held by each slot: the sliding-window mask compares positions, not slots
        self.slot_positions = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self._cache_kwarg = cache_keyword(model)
        self.graphs = StepGraphs(self.device, enabled=graphs, compile=compile, name="a decoding round")
        # prefills are recorded, not compiled: compiling every bucket would cost more than it saves once
        self.prefill_graphs = StepGraphs(self.device, enabled=graphs, name="the target's prefill")
        # padded prefills exist for graph replay; elsewhere a prompt runs as it is
        self.bucketed_prefill = self.prefill_graphs.enabled
        self._allocated = False  # the first forward allocates the cache, which a recording must not do
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._prefill_inputs: dict[int, InputBuffer] = {}  # bucket → [last prompt index, ids (bucket)]
        self._causal: dict[int, torch.Tensor] = {}
        self._causal_prefill = serves(model, self.sliding_window)  # eager prefills without a [P, P] mask
        self._zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self._slot_index = torch.arange(capacity, device=self.device)
        self.rounds: dict = {}  # (drafter id, mode) → its Round, whose buffers its recordings use (eyas.engine.round)
        self.fused: FusedLlamaForward | None = None
        if lean:
            why_not = "sliding-window attention" if self.sliding_window is not None else fused_support(model, layout)
            if why_not is None:
                self.fused = FusedLlamaForward(model, layout, self.cache, self.taps)
            else:
                log.info("eyas: the fused forward does not serve this target (%s); decoding through its HF forward", why_not)
        self._aux = torch.zeros(1, capacity, len(self.taps) * layout.hidden_size, dtype=self.dtype, device=self.device)
        self._hooks = self.taps.hooks(layout, [self._store(i) for i in range(len(self.taps))])

    @property
    def variant(self) -> str:
        """How decoding steps run, as reports name it: ``compile``, ``graphs`` or ``eager`` (a recording that failed
        turned graphs off), then ``+lean`` when the fused Llama forward serves."""
        kind = "compile" if self.graphs.compile else "graphs" if self.graphs.enabled else "eager"
        return kind + ("+lean" if self.fused is not None else "")

    @property
    def aux(self) -> torch.Tensor:
        """The aux states [1, capacity, k·Ht] of the last forward's tokens, in rows [0, n): rewritten by every forward."""
        return self._aux

    def _store(self, index: int):
        def store(hidden: torch.Tensor) -> None:
            # a copy into its slot, not a reference: the model may update its residual in place
            self.taps.view(self._aux, index)[:, : hidden.shape[1]].copy_(hidden.detach())
        return store

    def close(self) -> None:
        """Remove the hooks (the model is usable for anything else afterwards)."""
        self._hooks.remove()

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forget what was committed, run ``prompt`` [1, P] and commit it → (the last token's logits [V], aux
        [1, P, k·Ht]). Eagerly, attention over the prompt alone; with graphs, once a first forward has
        allocated the cache, a prompt of at most 512 tokens is padded to the next bucket and runs as that
        bucket's recorded step: on a GPU a replay of a few milliseconds instead of an eager forward's tens (a
        30-layer target launches ~1,000 kernels). The padding sits after the prompt, which causality keeps
        from seeing it, in slots the next forwards overwrite; only the last prompt token's logits are computed."""
        length = prompt.shape[1]
        self._check_room(0, length)
        bucket = self.prefill_bucket(length)
        if not (self.bucketed_prefill and self._allocated and self._keeps_logits and bucket is not None
                and bucket <= self.capacity):
            # an SDPA target without windows attends causally over the prompt alone, no [P, P] mask built
            causal = None if self._causal_prefill else \
                torch.ones(length, length, dtype=torch.long, device=self.device).tril()
            positions = self._slot_index[:length].view(1, length)
            # only the last token's logits: a long prompt's [P, V] logits cost a matmul and memory the size of the
            # target's head over every prompt token (8,192 × 49,152 for the demo target)
            last = torch.tensor([length - 1], device=self.device) if self._keeps_logits else None
            logits = self._forward(self._zero, prompt.to(self.device), positions, causal, keep=last, visible=length,
                                   hf=True)
            self.cache.consolidate()  # before any graph records the cache's addresses
            self._allocated = True
            self.length = length
            return logits[0, -1], self._aux[:, :length]
        if bucket not in self._prefill_inputs:
            self._prefill_inputs[bucket] = InputBuffer((1 + bucket,), torch.long, self.device)
            self._causal[bucket] = torch.ones(bucket, bucket, dtype=torch.long, device=self.device).tril()
        ids = torch.zeros(bucket, dtype=torch.long)
        ids[:length] = prompt[0]
        packed = self._prefill_inputs[bucket].fill(torch.cat([torch.tensor([length - 1]), ids]))
        positions = self._slot_index[:bucket].view(1, bucket)
        logits = self.prefill_graphs.run(bucket, lambda: self._forward(
            self._zero, packed[1:].view(1, bucket), positions, self._causal[bucket], keep=packed[:1]))
        self.length = length
        return logits[0, -1], self._aux[:, :length]

    def prefill_bucket(self, length: int) -> int | None:
        """The recorded prefill length a prompt of ``length`` tokens is padded to (None: longer ones run eagerly)."""
        return next((b for b in self.PREFILL_BUCKETS if b >= length), None)

    def verify(self, length: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
        """A decoding step, every shape fixed and no host synchronisation: ``ids`` [1, n] at ``positions`` [1, n]
        after ``length`` [1] committed tokens (held on the device), token i seeing token j of the step where
        ``tree`` [n, n] (0/1) says → logits [1, n, V]; their aux states are :attr:`aux`'s rows [0, n)."""
        return self._forward(length, ids, positions, tree)

    def _check_room(self, length: int, n: int) -> None:
        if length + n > self.capacity:
            raise EyasError(f"the sequence needs {length + n} cache slots, the engine holds {self.capacity}: "
                            "raise max_length (prompt + new tokens + draft tokens)")

    def _forward(self, length: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None,
                 keep: torch.Tensor | None = None, visible: int | None = None, hf: bool = False) -> torch.Tensor:
        """n tokens after ``length`` [1] committed ones: slots and mask come from the device-held length,
        attention over slots [0, ``visible``) (default: the whole capacity). ``keep`` [1]: the one position
        whose logits are computed (a prefill). ``hf``: the HF forward even when the fused one serves. ``tree`` None:
        a prefill of an empty cache (``visible`` = n), plain causal attention (:mod:`eyas.engine.causal_prefill`)."""
        n = ids.shape[1]
        visible = self.capacity if visible is None else visible
        slots = length + self._slot_index[:n]
        self.cache.slots, self.cache.visible = slots, visible
        self.slot_positions.index_copy_(0, slots, positions[0])
        extra = {} if keep is None else {"logits_to_keep": keep}
        if tree is None:
            with causal_prefill(self.model):
                return self._run_model(ids, positions, no_mask(self.device), **extra).logits
        tree = tree.bool()  # inside the step: recorded with it
        seen = (self._slot_index[:visible] < length).expand(n, visible).clone()
        seen.index_copy_(1, slots, tree)
        mask = self._masks(seen, positions[0])
        if self.fused is not None and keep is None and not hf:
            return self.fused.forward(ids, positions, mask, slots, self._aux)
        return self._run_model(ids, positions, mask, **extra).logits

    def _run_model(self, token_ids: torch.Tensor, positions: torch.Tensor, mask, **extra):
        self._hooks.arm((1, token_ids.shape[1], self.layout.hidden_size))
        try:
            out = self.model(input_ids=token_ids, position_ids=positions, attention_mask=mask,
                             use_cache=True, **{self._cache_kwarg: self.cache}, **extra)
        finally:
            problems = self._hooks.disarm()
        if problems:
            raise CaptureError("the engine's aux taps misfired: " + "; ".join(problems) + ". The target must run its "
                               "decoder layers as Python modules (not compiled or graph-replayed outside eyas' own graphs)")
        return out

    def move_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the cache entries (and their positions) at slots ``source`` to slots ``destination``, on
        the device: every source is read before any destination is written."""
        self.cache.move(source, destination)
        self.slot_positions.index_copy_(0, destination, self.slot_positions.index_select(0, source))

    def _masks(self, visible: torch.Tensor, positions: torch.Tensor):
        """The additive mask(s) from ``visible`` [n, width]: one tensor, or a dict per layer type when some
        layers slide (a query sees keys fewer than ``sliding_window`` positions back)."""
        near = None if self.sliding_window is None else \
            (positions[:, None] - self.slot_positions[None, : visible.shape[1]]) < self.sliding_window
        return layer_masks(visible, near, self.sliding_everywhere, self.dtype)
