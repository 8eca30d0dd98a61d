"""The drafter side: a preallocated KV cache with committed and speculative parts.

Positions whose target states are known (the prompt, then each round's accepted tokens) are
*committed*: they stay. Drafting steps after them are *speculative*: each round's steps see one
another, and ``rollback`` drops them all before the next round commits what the target accepted.
The layer itself is :meth:`Eagle3Drafter.layer`, the same code training runs (only attention differs),
and the chained step is :mod:`eyas.drafter.step`'s rule: hidden = previous pre-norm output, token =
previous draft mapped to a target id, position + 1.

Every step sees the committed positions and a window of speculative ones after them: which of the
window's entries each new position sees is a bool mask [n, window] (a chain sees all earlier drafts
and the new ones causally; a tree node its ancestors). With ``static_shapes`` (and on CUDA
``graphs``) each step reads its inputs from per-shape buffers, attends over the whole capacity and
builds that mask on the device, and also returns its top-k draft log-probabilities, so a step is one
graph replay (:mod:`eyas.engine.graphs`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.attention import additive_mask, attend, kernels_available
from eyas.engine.graphs import InputBuffer, StepGraphs
from eyas.engine.topk import largest


class DraftRunner:
    """An :class:`Eagle3Drafter` with a KV cache of ``capacity`` positions (batch 1)."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int, static_shapes: bool = False, graphs: bool = False):
        self.drafter, self.capacity = drafter, capacity
        param = drafter.fc.weight
        self.device, self.dtype = param.device, param.dtype
        config = drafter.config
        shape = (1, config.num_attention_heads, capacity, config.head_dim)  # keys stored after GQA expansion
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.length = 0  # committed positions
        self.speculative = 0  # drafted positions after them, visible until rollback
        # graphs need static shapes; off CUDA there are no graphs and attending over empty slots only costs
        self.static_shapes = static_shapes or (graphs and self.device.type == "cuda")
        # recorded, never compiled: the drafter's many step shapes (each committed count, each tree level) pass
        # dynamo's recompile limit, and compiling them made chain:5 2.5× slower on the H200 (BENCHMARKS.md)
        self.graphs = StepGraphs(self.device, enabled=graphs, name="a drafter step")
        self._slot_index = torch.arange(capacity, device=self.device)
        self._offsets: torch.Tensor | None = None  # the running step's [committed length, first new slot]
        self._inputs: dict[tuple, tuple[InputBuffer, ...]] = {}
        self._window: torch.Tensor | None = None  # the mask of the step being run [n, window]
        self._fused = drafter.fused_projections()  # q/k/v and gate/up one matmul each: 3 kernels fewer a pass
        self._kernels = kernels_available(self.device)
        self.prepared_modes: set[str] = set()  # speculation modes whose round shapes are recorded (decode.py)

    def reset(self) -> None:
        self.length = self.speculative = 0

    @property
    def shapes(self) -> frozenset[tuple]:
        """The fixed step shapes run so far (static shapes); on a GPU each is one recorded CUDA graph."""
        return frozenset(self._inputs)

    def is_prompt(self, from_target: bool) -> bool:
        """True for the prompt's states, the first commit of a generation. Those run eagerly, as the
        target's prefill does: a static shape (and a CUDA graph with its memory pool) per prompt length
        would be recorded while decoding, once for every new length, and kept for good."""
        return from_target and self.length == 0

    def rollback(self) -> None:
        """Forget this round's drafted positions."""
        self.speculative = 0

    def _causal_window(self, n: int) -> torch.Tensor:
        window = torch.ones(n, self.speculative + n, dtype=torch.bool)
        window[:, self.speculative :] = window[:, self.speculative :].tril()
        return window

    @torch.no_grad()
    def step(self, x: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, window: torch.Tensor,
             commit: bool, top_k: int = 0, from_target: bool = False):
        """One layer pass over n new positions → (pre-norm [1, n, H], top-k log-probs [n, top_k], their
        draft ids [n, top_k]) — the last two None when ``top_k`` is 0. ``x``: the hidden states [1, n, H],
        or the target's aux states [1, n, k·Ht] when ``from_target`` (fc applied first). ``window``
        [n, speculative + n]: which speculative entries and new positions each sees. ``commit``: the new
        positions join the committed ones (only right after a rollback)."""
        n = token_ids.shape[1]
        if commit and self.speculative:
            raise ValueError("commit the target's states before drafting (after rollback)")
        if self.length + self.speculative + n > self.capacity:
            raise ValueError(f"the drafter cache holds {self.capacity} positions, {self.length + self.speculative + n} needed")
        if self.static_shapes and not self.is_prompt(from_target):
            out = self._step_static(x, token_ids, positions, window, top_k, from_target)
        else:
            self._window = window.to(self.device)
            out = self._compute(x.to(self.device), token_ids.to(self.device), positions.to(self.device), top_k,
                                from_target, self._attend)
        if commit:
            self.length += n
        else:
            self.speculative += n
        return out

    def _compute(self, x, token_ids, positions, top_k: int, from_target: bool, attend):
        hidden = self.drafter.fc(x.to(self.dtype)) if from_target else x
        prenorm = self.drafter.layer(hidden, token_ids, positions, attend, self._fused)
        if not top_k:
            return prenorm, None, None
        logits = self.drafter.logits(prenorm)[0]
        # the top-k of the logits is the top-k of the log-probabilities; only those k are normalised
        best, ids = largest(logits, top_k)
        scores = best.float() - torch.logsumexp(logits.float(), -1, keepdim=True)
        return prenorm, scores, ids

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Eager: keys written at [start, start + n), attention over [0, start + n)."""
        n, start = q.shape[2], self.length + self.speculative
        self.keys[:, :, start : start + n] = k
        self.values[:, :, start : start + n] = v
        visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
        visible[:, self.length :] = self._window
        return F.scaled_dot_product_attention(q, self.keys[:, :, : start + n], self.values[:, :, : start + n], attn_mask=visible)

    def _step_static(self, x, token_ids, positions, window, top_k: int, from_target: bool):
        n, width = token_ids.shape[1], window.shape[1]
        key = (n, width, top_k, from_target)
        if key not in self._inputs:
            self._inputs[key] = (InputBuffer((1, n, x.shape[-1]), x.dtype if from_target else self.dtype, self.device),
                                 InputBuffer((1, n), torch.long, self.device), InputBuffer((n, width), torch.bool, self.device),
                                 InputBuffer((2 + n,), torch.long, self.device))
        xs, ids, mask, where = self._inputs[key]
        xs, ids, mask = xs.fill(x), ids.fill(token_ids), mask.fill(window)
        # committed length, first new slot, positions: host numbers, one copy
        where = where.fill(torch.cat([torch.tensor([self.length, self.length + self.speculative]), positions.reshape(-1).cpu()]))

        def run():
            self._window, self._offsets = mask, where[:2]
            return self._compute(xs, ids, where[2:].view(1, n), top_k, from_target, self._attend_static)
        return self.graphs.run(key, run)

    def _attend_static(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Static shapes: keys written at slots from the device-held offsets, attention over the whole
        capacity; slot s is seen when committed, or when it lies in the window and the mask allows it."""
        n, width = q.shape[2], self._window.shape[1]
        offsets = self._offsets
        slots = offsets[1] + self._slot_index[:n]
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        relative = self._slot_index - offsets[0]  # slot's place in the window (negative: committed)
        in_window = (relative >= 0) & (relative < width)
        visible = (relative < 0) | (self._window[:, relative.clamp(0, width - 1)] & in_window)
        if self._kernels:  # the split-cache kernels (eyas.engine.attention) take an additive mask
            out = attend(q, self.keys, self.values, additive_mask(visible, q.dtype), q.shape[-1] ** -0.5)
            if out is not None:
                return out.view(1, n, -1, q.shape[-1]).transpose(1, 2)
        return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=visible)

    @torch.no_grad()
    def draft_chain(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, steps: int) -> torch.Tensor:
        """Commit the target states ``aux`` [1, n, k·Ht] (each with the token after it, [1, n]) and
        draft ``steps`` tokens greedily after them → target ids [steps] (on the drafter's device: no
        host synchronisation between steps). With static shapes the whole chain is one step (one graph)."""
        self.rollback()
        if self.static_shapes and not self.is_prompt(True):
            return self._draft_chain_static(aux, next_tokens, positions, steps)
        prenorm, _, ids = self.commit(aux, next_tokens, positions, top_k=1)
        prenorm = prenorm[:, -1:]
        token = self.drafter.to_target_ids(ids[-1:, :1]).view(1, 1)
        position = int(positions[0, -1])
        drafted = [token]
        for _ in range(1, steps):
            position += 1
            prenorm, _, ids = self.step(prenorm, token, torch.tensor([[position]]), self._causal_window(1), commit=False,
                                        top_k=1)
            token = self.drafter.to_target_ids(ids[:, :1]).view(1, 1)
            drafted.append(token)
        self.rollback()
        return torch.cat(drafted, dim=1)[0]

    @torch.no_grad()
    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, top_k: int = 0):
        """Drop any drafted positions and commit target states ``aux`` [1, n, k·Ht] (each with the token after
        it [1, n]), causally → :meth:`step`'s (pre-norm, top-k log-probs, draft ids). With ``top_k`` 0 nothing
        is drafted: a prompt's states, before device-resident rounds commit its last one and draft from it."""
        self.rollback()
        n = next_tokens.shape[1]
        return self.step(aux, next_tokens, positions, torch.ones(n, n, dtype=torch.bool).tril(), commit=True,
                         top_k=top_k, from_target=True)

    def commit_on_device(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                         length: torch.Tensor, valid: torch.Tensor, top_k: int):
        """Commit target states with every number on the device (recordable): ``aux`` [1, n, k·Ht] with the
        token after each [1, n] at ``positions`` [1, n] are written at slots from ``length`` [1]; the first
        ``valid`` [1] of them count (the later slots are overwritten by the drafts before anything reads
        them). → the last valid one's (pre-norm [1, 1, H], top-k log-probs [1, top_k], draft ids [1, top_k],
        position [1, 1]) and the committed length after it [1]."""
        n = next_tokens.shape[1]
        self._window = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        self._offsets = torch.cat([length, length])
        prenorm, scores, ids = self._compute(aux, next_tokens, positions, top_k, True, self._attend_static)
        last = valid - 1
        return (prenorm.index_select(1, last), scores.index_select(0, last), ids.index_select(0, last),
                positions[0].index_select(0, last).view(1, 1), length + valid)

    def speculate_on_device(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                            committed: torch.Tensor, written: int, window: torch.Tensor, top_k: int):
        """A drafting step after ``committed`` [1] positions and ``written`` speculative entries, every number
        on the device: the new entries go after those, and ``window`` [n, written + n] says which of the
        speculative entries and new positions each sees → (pre-norm, top-k log-probs, draft ids) as :meth:`step`."""
        self._window = window
        self._offsets = torch.cat([committed, committed + written])
        return self._compute(hidden, token_ids, positions, top_k, False, self._attend_static)

    def chain_on_device(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                        length: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
        """:meth:`commit_on_device`, then ``steps`` greedy drafts from the last valid state → target ids [steps]."""
        hidden, _, ids, position, committed = self.commit_on_device(aux, next_tokens, positions, length, valid, 1)
        token = self.drafter.to_target_ids(ids).view(1, 1)
        drafted = [token]
        for step in range(1, steps):  # step i sees the committed positions and the i − 1 drafts before it
            position = position + 1
            window = torch.ones(1, step, dtype=torch.bool, device=self.device)
            hidden, _, ids = self.speculate_on_device(hidden, token, position, committed, step - 1, window, 1)
            token = self.drafter.to_target_ids(ids).view(1, 1)
            drafted.append(token)
        return torch.cat(drafted, dim=1)[0]

    def _draft_chain_static(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                            steps: int) -> torch.Tensor:
        """The commit step and every drafting step in one recorded function: each step's token, hidden
        state, position and cache offsets are computed on the device from the one before."""
        n = next_tokens.shape[1]
        if self.length + n + steps - 1 > self.capacity:
            raise ValueError(f"the drafter cache holds {self.capacity} positions, {self.length + n + steps - 1} needed")
        key = ("chain", n, steps)
        if key not in self._inputs:
            self._inputs[key] = (InputBuffer((1, n, aux.shape[-1]), aux.dtype, self.device),
                                 InputBuffer((1 + 2 * n,), torch.long, self.device))
        xs, numbers = self._inputs[key]
        xs = xs.fill(aux)
        # committed length, the tokens after each state, their positions: host numbers, one copy
        numbers = numbers.fill(torch.cat([torch.tensor([self.length]), next_tokens.reshape(-1).cpu(),
                                          positions.reshape(-1).cpu()]))

        def run():
            length, tokens, where = numbers[:1], numbers[1 : 1 + n].view(1, n), numbers[1 + n :].view(1, n)
            every = self._slot_index[n - 1 : n] + 1  # n, on the device: every state counts
            return self.chain_on_device(xs, tokens, where, length, every, steps)

        drafted = self.graphs.run(key, run)
        self.length += n  # the states are committed; the drafts were speculative and are dropped
        return drafted
