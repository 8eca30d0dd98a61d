"""The drafter side: an :class:`Eagle3Drafter` over a preallocated KV cache, its passes with fixed shapes.

Positions whose target states are known (the prompt, then each round's accepted tokens) are
*committed*: they stay. A round's drafting passes write *speculative* entries after them, which the
next round's commit overwrites. The layer itself is :meth:`Eagle3Drafter.layer`, the same code training
runs (only attention differs); a drafting step chains as the training-time test does: hidden = the
previous step's (its pre-norm output; the post-norm one under EAGLE-3.1's norm_output), token = the previous draft
mapped to a target id, position + 1. "pre-norm" below names that hidden.

A round's passes (:meth:`commit`, :meth:`speculate`) take every number — the committed length, how many
states count — as device tensors and attend over the cache (the GPU's kernels stop at the window's end), the mask
built on the device: the same shapes every round, no host synchronisation, so a round is recorded as one CUDA graph
(:mod:`eyas.engine.graphs`). A prompt's states are committed once per generation by
:meth:`commit_prompt`, eagerly, as the target's prefill: a shape per prompt length would be recorded
for good.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.families.eagle3.model import Eagle3Drafter
from eyas.engine.attention import additive_mask, attend, kernels_available
from eyas.engine.cpu_head import vocab_head
from eyas.engine.topk import largest


class DraftRunner:
    """An :class:`Eagle3Drafter` with a KV cache of ``capacity`` positions (batch 1)."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int):
        self.drafter, self.capacity = drafter, capacity
        param = drafter.fc.weight
        self.device, self.dtype = param.device, param.dtype
        config = drafter.config
        shape = (1, config.num_attention_heads, capacity, config.head_dim)  # keys stored after GQA expansion
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.length = 0  # committed positions, as the host last saw them
        self._slot_index = torch.arange(capacity, device=self.device)
        self._offsets: torch.Tensor | None = None  # the running pass's [committed length, first new slot]
        self._window: torch.Tensor | None = None  # the mask of the pass being run [n, window]
        self._fused = drafter.fused_projections()  # q/k/v and gate/up one matmul each: 3 kernels fewer a pass
        self._kernels = kernels_available(self.device)
        self._head = vocab_head(drafter.lm_head)  # on a CPU, prepacked for oneDNN: the drafter's largest matmul

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The target layers whose states the drafter reads (eyas ids)."""
        return tuple(self.drafter.config.layer_ids)

    def reset(self) -> None:
        """Forget every committed position (a new prompt)."""
        self.length = 0

    @torch.no_grad()
    def commit_prompt(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Commit a prompt's target states ``aux`` [1, n, k·Ht], each with the token after it [1, n], causally
        after the committed ones, eagerly (attention over what exists)."""
        n = next_tokens.shape[1]
        if self.length + n > self.capacity:
            raise ValueError(f"the drafter cache holds {self.capacity} positions, {self.length + n} needed")
        self._window = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        self._compute(aux.to(self.device), next_tokens.to(self.device), positions.to(self.device), 0, True, self._attend)
        self.length += n

    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, length: torch.Tensor,
               valid: torch.Tensor, top_k: int):
        """Commit target states with every number on the device: ``aux`` [1, n, k·Ht] with the token after each
        [1, n] at ``positions`` [1, n] are written at slots from ``length`` [1]; the first ``valid`` [1] of them
        count (the later slots are overwritten by the drafts before anything reads them). → the last valid
        one's (pre-norm [1, 1, H], top-k log-probs [1, top_k], draft ids [1, top_k], position [1, 1]) and the
        committed length after it [1]."""
        n = next_tokens.shape[1]
        self._window = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        self._offsets = torch.cat([length, length])
        prenorm, scores, ids = self._compute(aux, next_tokens, positions, top_k, True, self._attend_static)
        last = valid - 1
        pick = (lambda x: None) if not top_k else (lambda x: x.index_select(0, last))  # top_k 0: no proposals
        return (prenorm.index_select(1, last), pick(scores), pick(ids), positions[0].index_select(0, last).view(1, 1),
                length + valid)

    def speculate(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, committed: torch.Tensor,
                  written: int, window: torch.Tensor, top_k: int):
        """A drafting pass after ``committed`` [1] positions and ``written`` speculative entries, every number on
        the device: the new entries go after those, and ``window`` [n, written + n] says which of the
        speculative entries and new positions each sees → (pre-norm [1, n, H], top-k log-probs [n, top_k],
        their draft ids [n, top_k])."""
        self._window = window
        self._offsets = torch.cat([committed, committed + written])
        return self._compute(hidden, token_ids, positions, top_k, False, self._attend_static)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The drafter's logits over its vocabulary [n, Vd] after step hiddens [1, n, H] (:meth:`Eagle3Drafter.layer`)."""
        return self._head(self.drafter.head_input(prenorm))[0]

    def vocabulary(self) -> torch.Tensor:
        """The target id of each draft-vocabulary entry [Vd]."""
        return self.drafter.vocabulary()

    def _compute(self, x, token_ids, positions, top_k: int, from_target: bool, attend):
        hidden = self.drafter.fuse(x.to(self.dtype)) if from_target else x
        prenorm = self.drafter.layer(hidden, token_ids, positions, attend, self._fused)
        if not top_k:
            return prenorm, None, None
        logits = self.logits(prenorm)
        # the top-k of the logits is the top-k of the log-probabilities; only those k are normalised
        best, ids = largest(logits, top_k)
        scores = best.float() - torch.logsumexp(logits.float(), -1, keepdim=True)
        return prenorm, scores, ids

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Eager (a prompt): keys written at [length, length + n), attention over [0, length + n)."""
        n, start = q.shape[2], self.length
        self.keys[:, :, start : start + n] = k
        self.values[:, :, start : start + n] = v
        visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
        visible[:, start:] = self._window
        return F.scaled_dot_product_attention(q, self.keys[:, :, : start + n], self.values[:, :, : start + n], attn_mask=visible)

    def _attend_static(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Fixed shapes: keys written at slots from the device-held offsets, attention over the whole capacity
        (the kernels stop at the window's end); slot s is seen when committed, or when it lies in the window and the mask allows it."""
        n, width = q.shape[2], self._window.shape[1]
        offsets = self._offsets
        slots = offsets[1] + self._slot_index[:n]
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        relative = self._slot_index - offsets[0]  # slot's place in the window (negative: committed)
        in_window = (relative >= 0) & (relative < width)
        visible = (relative < 0) | (self._window[:, relative.clamp(0, width - 1)] & in_window)
        if self._kernels:  # the split-cache kernels (eyas.engine.attention) take an additive mask
            # nothing past the window is seen: attention stops at its end, however large the cache
            out = attend(q, self.keys, self.values, additive_mask(visible, q.dtype), q.shape[-1] ** -0.5,
                         offsets[:1] + width)
            if out is not None:
                return out.view(1, n, -1, q.shape[-1]).transpose(1, 2)
        return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=visible)
