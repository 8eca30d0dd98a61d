"""The target side of speculative decoding: forwards over a slot cache, with the EAGLE-3 aux states.

Every forward gets the tokens, their positions and, for a tree, which of the new tokens each may
see. Committed tokens occupy cache slots [0, length); a forward writes its n tokens at
[length, length+n) and sees every committed slot plus the new ones its mask allows. ``commit``
then keeps the accepted new tokens, copying them down to [length, length+a) when a tree scattered
them. The aux states (residual stream entering each tapped layer, DESIGN "Conventions") come from
pre-hooks that must fire exactly once per forward, as in capture — a compiled or graph-replayed
model that skips them is refused rather than drafting from stale states.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import torch
from torch import nn

from eyas.engine.attention import additive_mask
from eyas.engine.fused_llama import LeanForward, lean_support
from eyas.engine.graphs import InputBuffer, StepGraphs
from eyas.engine.kv import SlotCache
from eyas.errors import CaptureError, EyasError
from eyas.target.compat import cache_keyword
from eyas.target.layer_ids import default_layer_ids, validate_layer_ids
from eyas.target.layout import TargetLayout, text_config

log = logging.getLogger(__name__)


class TargetRunner:
    """An HF causal LM behind a :class:`SlotCache` of ``capacity`` tokens (batch 1)."""

    BURST = 32  # the most greedy plain steps run between two host synchronisations
    # prompts padded up to one of these lengths replay that length's recorded prefill; longer ones run
    # eagerly, where launches no longer dominate (and a recording's mask would grow with length × capacity)
    PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)

    def __init__(self, model: nn.Module, layout: TargetLayout, layer_ids: Sequence[int] | None, capacity: int,
                 static_shapes: bool = False, graphs: bool = False, compile: bool = False, lean: bool = False):
        """``static_shapes``: every forward after the prefill attends over the whole capacity, reads its
        inputs from per-shape buffers and builds its mask on the device from the committed length, so a
        forward of n tokens always has the same shapes and addresses — what a CUDA graph needs (slower
        in eager mode: attention spans empty slots, masked). ``graphs`` (implies static shapes): on
        CUDA, replay those forwards from CUDA graphs (:mod:`eyas.engine.graphs`), ``compile``: fused by
        ``torch.compile`` first. A target whose forward cannot be recorded (data-dependent MoE routing
        on the host, say) falls back to eager forwards with a warning. ``lean``: with static shapes, a
        Llama-family target's decoding forwards take :mod:`eyas.engine.fused_llama`'s path (fused projections,
        aux states written without hooks); the prefill always runs the HF forward."""
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in ("sdpa", "eager"):
            raise EyasError(f"the engine needs sdpa or eager attention (it passes tree masks); the target uses {attention!r}: "
                            "load it with attn_implementation='sdpa'")
        self.model, self.layout, self.capacity = model, layout, capacity
        self.layer_ids = validate_layer_ids(layer_ids or default_layer_ids(layout.num_layers), layout.num_layers)
        self.device = layout.embed.weight.device
        self.dtype = layout.embed.weight.dtype
        config = text_config(model.config)
        types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        # Which layers slide: those typed so (Gemma 3, Qwen2 with use_sliding_window), or — when a model
        # has a window but no layer types (Mistral, Mixtral) — all of them, as its HF forward does
        self.sliding_window = window if "sliding_attention" in types or (window is not None and not types) else None
        self.sliding_everywhere = self.sliding_window is not None and not types
        self.cache = SlotCache(int(config.num_hidden_layers), capacity)
        self.length = 0
        # position held by each slot: the sliding-window mask compares positions, not slots
        self.slot_positions = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self._cache_kwarg = cache_keyword(model)
        # graphs need static shapes; off CUDA there are no graphs and attending over empty slots only costs
        self.static_shapes = static_shapes or (graphs and self.device.type == "cuda")
        self.graphs = StepGraphs(self.device, enabled=graphs, compile=compile, name="the target's forward")
        # prefills are recorded, not compiled: compiling every bucket would cost more than it saves once
        self.prefill_graphs = StepGraphs(self.device, enabled=graphs, name="the target's prefill")
        self._allocated = False  # the first forward allocates the cache, which a recording must not do
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._prefill_inputs: dict[int, InputBuffer] = {}  # bucket → [last prompt index, ids (bucket)]
        self._causal: dict[int, torch.Tensor] = {}
        self._zero = torch.zeros(1, dtype=torch.long, device=self.device)
        # n → one buffer [committed length, ids (n), positions (n), tree mask (n·n)]: one copy per forward
        self._inputs: dict[int, InputBuffer] = {}
        self._slot_index = torch.arange(capacity, device=self.device)
        self.lean: LeanForward | None = None
        # greedy plain decoding in bursts: [committed length, last token, burst index] and the burst's tokens
        self._burst_numbers = InputBuffer((3,), torch.long, self.device)
        self._burst_tokens = torch.zeros(self.BURST, dtype=torch.long, device=self.device)
        self._one = torch.ones(1, 1, dtype=torch.long, device=self.device)
        self.bursts: dict = {}  # (drafter id, mode) → its RoundBurst, whose buffers its recorded round uses
        if lean and self.static_shapes:
            why_not = "sliding-window attention" if self.sliding_window is not None else lean_support(model, layout)
            if why_not is None:
                self.lean = LeanForward(model, layout, self.cache, self.layer_ids)
            else:
                log.info("eyas: the lean forward does not serve this target (%s); decoding through its HF forward", why_not)
        self._aux: torch.Tensor | None = None  # [1, capacity, k·Ht], allocated on the first tap
        self._tokens = 0  # tokens of the forward in flight: where the taps write
        self._calls = [0] * len(self.layer_ids)
        self._hooks = [self._tap_module(i).register_forward_pre_hook(self._hook(j), with_kwargs=True)
                       for j, i in enumerate(self.layer_ids)]

    def _tap_module(self, layer_id: int) -> nn.Module:
        return self.layout.layers[layer_id] if layer_id < self.layout.num_layers else self.layout.norm

    def _hook(self, index: int):
        def record(module, args, kwargs):
            if not self._tokens:
                return  # the model runs for someone else (e.g. transformers' generate): not ours to record
            self._calls[index] += 1
            hidden = (args[0] if args else kwargs["hidden_states"]).detach()
            width = hidden.shape[-1]
            if self._aux is None:
                self._aux = hidden.new_empty(1, self.capacity, width * len(self.layer_ids))
            # a copy into its slice, not a reference: the model may update its residual in place
            self._aux[:, : self._tokens, index * width : (index + 1) * width].copy_(hidden)
        return record

    def close(self) -> None:
        """Remove the hooks (the model is usable for anything else afterwards)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def reset(self) -> None:
        """Forget every committed token (a new prompt); the buffers stay allocated."""
        self.length = 0

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None = None,
                drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``token_ids`` [1, n] at ``positions`` [1, n] → (logits [1, n, V], aux [1, n, k·Ht]).

        ``tree_mask`` [n, n] (True = may attend) says which new tokens each new token sees; causal if None.
        ``drafted`` [m]: tokens on the device that follow ``token_ids`` (a chain's drafts, n counts them
        too): with static shapes they are copied into the step's input on the device, so the host never
        waits for the drafter. With static shapes both results are buffers, valid until the next forward
        of the same length.
        """
        if drafted is not None and not (self.static_shapes and self.length > 0):
            token_ids = torch.cat([token_ids, drafted.cpu().view(1, -1)], dim=1)
            drafted = None
        n = token_ids.shape[1] + (0 if drafted is None else drafted.numel())
        self._check_room(n)
        if self.static_shapes and self.length > 0:
            return self._forward_static(token_ids, positions, tree_mask, drafted)
        slots = torch.arange(self.length, self.length + n, device=self.device)
        self.cache.slots = slots
        # eager: attend over what exists; static shapes (the prefill): over the whole capacity, the rest masked
        self.cache.visible = self.capacity if self.static_shapes else self.length + n
        positions = positions.to(self.device)
        self.slot_positions[slots] = positions[0]
        mask = self._mask(n, positions[0], tree_mask)
        out = self._run_model(token_ids.to(self.device), positions, mask)
        if self.static_shapes:
            self.cache.consolidate()  # before any graph records the cache's addresses
        self._allocated = True
        aux = self._aux[:, :n]
        return out.logits, aux if self.static_shapes else aux.clone()

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forget what was committed, run ``prompt`` [1, P] and commit it → (the last token's logits [V],
        aux [1, P, k·Ht]). With static shapes, once a first forward has allocated the cache, a prompt of
        at most 512 tokens is padded to the next bucket and runs as that bucket's static step: on a GPU
        a replay of a few milliseconds instead of an eager forward's tens (a 30-layer target launches
        ~1,000 kernels). The padding sits after the prompt, which causality keeps from seeing it, in
        slots the next forwards overwrite; only the last prompt token's logits are computed."""
        self.reset()
        length = prompt.shape[1]
        bucket = next((b for b in self.PREFILL_BUCKETS if b >= length), None)
        if not (self.static_shapes and self._allocated and self._keeps_logits and bucket is not None
                and bucket <= self.capacity):
            logits, aux = self.forward(prompt, torch.arange(length).unsqueeze(0))
            self.commit(torch.arange(length))
            return logits[0, -1], aux[:, :length]
        if bucket not in self._prefill_inputs:
            self._prefill_inputs[bucket] = InputBuffer((1 + bucket,), torch.long, self.device)
            self._causal[bucket] = torch.ones(bucket, bucket, dtype=torch.bool, device=self.device).tril()
        ids = torch.zeros(bucket, dtype=torch.long)
        ids[:length] = prompt[0]
        packed = self._prefill_inputs[bucket].fill(torch.cat([torch.tensor([length - 1]), ids]))
        positions = self._slot_index[:bucket].view(1, bucket)
        logits = self.prefill_graphs.run(bucket, lambda: self._static_step(
            self._zero, packed[1:].view(1, bucket), positions, self._causal[bucket], keep=packed[:1]))
        self.length = length
        return logits[0, -1], self._aux[:, :length]

    def _check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise EyasError(f"the sequence needs {self.length + n} cache slots, the engine holds {self.capacity}: "
                            "raise max_length (prompt + new tokens + draft tokens)")

    def _run_model(self, token_ids: torch.Tensor, positions: torch.Tensor, mask, **extra):
        n = token_ids.shape[1]
        self._tokens = n
        self._calls = [0] * len(self.layer_ids)
        try:
            out = self.model(input_ids=token_ids, position_ids=positions, attention_mask=mask,
                             use_cache=True, **{self._cache_kwarg: self.cache}, **extra)
        finally:
            self._tokens = 0
        bad = [i for i, calls in zip(self.layer_ids, self._calls, strict=True) if calls != 1]
        if bad:
            raise CaptureError(f"the aux taps at layer ids {bad} fired {[self._calls[self.layer_ids.index(i)] for i in bad]} "
                               "times in one forward (expected once): the target must run its decoder layers as "
                               "Python modules (not compiled or graph-replayed without eyas' own graphs)")
        return out

    def _forward_static(self, token_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
                        drafted: torch.Tensor | None = None):
        given = token_ids.shape[1]
        n = given + (0 if drafted is None else drafted.numel())
        if n not in self._inputs:
            self._inputs[n] = InputBuffer((1 + 2 * n + n * n,), torch.long, self.device)
        tree = tree_mask if tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        host_ids = token_ids.reshape(-1).cpu()
        if drafted is not None:  # placeholders, overwritten on the device right after the copy
            host_ids = torch.cat([host_ids, torch.zeros(n - given, dtype=torch.long)])
        packed = self._inputs[n].fill(torch.cat([torch.tensor([self.length]), host_ids,
                                                 positions.reshape(-1).cpu(), tree.reshape(-1).cpu().long()]))
        if drafted is not None:
            packed[1 + given : 1 + n].copy_(drafted.reshape(-1))  # queued after the fill: stream order
        inputs = packed[:1], packed[1 : 1 + n].view(1, n), packed[1 + n : 1 + 2 * n].view(1, n), packed[1 + 2 * n :].view(n, n)
        logits = self.graphs.run(n, lambda: self._static_step(*inputs))
        return logits, self._aux[:, :n]

    @torch.no_grad()
    def greedy_burst(self, token: int, steps: int) -> list[int]:
        """Greedy plain decoding with static shapes: run ``token`` (emitted, not yet run) and the ``steps`` − 1
        tokens after it, each step's argmax feeding the next on the device — no host synchronisation
        until the burst's ``steps`` new tokens are read back. All of them are committed; the caller
        stops at an end-of-sequence id among them (the cache past it is never read again)."""
        if not self.static_shapes or self.length == 0 or not 0 < steps <= self.BURST:
            raise ValueError("greedy_burst needs static shapes, a prefilled prompt and 1..BURST steps")
        self._check_room(steps)
        numbers = self._burst_numbers

        def step():
            state = numbers.tensor  # read and advanced in place: replays chain on the device
            logits = self._static_step(state[0:1], state[1:2].view(1, 1), state[0:1].view(1, 1), self._one)
            chosen = logits[0, -1].argmax()
            self._burst_tokens.index_copy_(0, state[2:3], chosen.view(1))
            state[1].copy_(chosen)
            state[0].add_(1)
            state[2].add_(1)

        start = torch.tensor([self.length, token, 0])
        numbers.fill(start)
        if self.graphs.ensure("burst", step):
            numbers.fill(start)  # the recording's warm-up runs advanced the state
        for _ in range(steps):
            self.graphs.run("burst", step)
        self.length += steps
        return self._burst_tokens[:steps].tolist()

    def _static_step(self, length: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                     tree: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """A forward of n tokens after the committed ones, every shape fixed and no host synchronisation:
        slots and mask come from the committed ``length`` [1] held on the device; ``tree`` [n, n] (0/1).
        ``keep`` [1]: the one position whose logits are computed (a prefill), through the HF forward."""
        n = ids.shape[1]
        tree = tree.bool()  # inside the step: recorded with it
        slots = length + self._slot_index[:n]
        self.cache.slots = slots
        self.cache.visible = self.capacity
        self.slot_positions.index_copy_(0, slots, positions[0])
        visible = (self._slot_index < length).expand(n, self.capacity).clone()
        visible.index_copy_(1, slots, tree)
        mask = self._masks(visible, positions[0])
        if keep is not None:
            return self._run_model(ids, positions, mask, logits_to_keep=keep).logits
        if self.lean is not None:
            return self.lean.forward(ids, positions, mask, slots, self._aux)
        return self._run_model(ids, positions, mask).logits

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the new tokens at indices ``keep`` (ascending) of the last forward, in that order."""
        keep = keep.cpu()
        count = len(keep)
        if not torch.equal(keep, torch.arange(count)):  # a tree's scattered path: copy it down
            moves = torch.stack([self.length + keep, torch.arange(self.length, self.length + count)]).to(self.device)
            self.move_slots(moves[0], moves[1])
        self.length += count

    def move_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the cache entries (and their positions) at slots ``source`` to slots ``destination``, on
        the device: every source is read before any destination is written."""
        self.cache.move(source, destination)
        self.slot_positions.index_copy_(0, destination, self.slot_positions.index_select(0, source))

    def _mask(self, n: int, positions: torch.Tensor, tree_mask: torch.Tensor | None):
        """Additive float mask [1, 1, n, visible slots] (a dict per layer type when some layers slide)."""
        width = self.cache.visible
        visible = torch.zeros(n, width, dtype=torch.bool, device=self.device)
        visible[:, : self.length] = True
        new = tree_mask.to(self.device) if tree_mask is not None else torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        visible[:, self.length : self.length + n] = new
        return self._masks(visible, positions)

    def _masks(self, visible: torch.Tensor, positions: torch.Tensor):
        """The additive mask(s) from ``visible`` [n, width]: one tensor, or a dict per layer type when some
        layers slide (a query sees keys fewer than ``sliding_window`` positions back)."""
        if self.sliding_window is None:
            return self._additive(visible)
        near = (positions[:, None] - self.slot_positions[None, : visible.shape[1]]) < self.sliding_window
        if self.sliding_everywhere:
            return self._additive(visible & near)
        return {"full_attention": self._additive(visible), "sliding_attention": self._additive(visible & near)}

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        return additive_mask(visible, self.dtype)
