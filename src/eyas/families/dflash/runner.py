"""The block drafter's side of a round: a :class:`DFlashDrafter` over a cache of its context keys, fixed shapes.

The drafter's context is one row per position the target has run (fc + hidden_norm of the target's tapped states);
each layer's keys and values of those rows are computed once, when the target accepts the position (*commit*), and
kept in a cache indexed by position. Drafting runs one block — the root (the last emitted token, at the target's
committed length) followed by B − 1 mask tokens — through every layer in one forward, each block row seeing the
cache's slots before the root and the whole block: :meth:`eyas.families.dflash.model.DFlashDrafter.block_hidden`, the code
training runs, with the cache as the context. A round commits every state its verify returned, accepted or not: those
past what the target accepted lie at positions the next block starts at or after, masked until overwritten.

Every number a round passes (positions, the root, the committed length) is a device tensor and attention spans the
whole cache under a mask built on the device: a round is recorded as one CUDA graph, as EAGLE-3's
(:mod:`eyas.families.eagle3.runner`). A prompt's states are committed eagerly, once per generation.

A block drafter proposes one chain of up to block − 1 tokens a round: :func:`check_block_modes` refuses any other mode.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from eyas.engine.cpu_head import vocab_head
from eyas.errors import EyasError
from eyas.families.dflash.model import DFlashDrafter
from eyas.speculation import Speculation


class BlockDraftRunner:
    """A :class:`DFlashDrafter` with a context cache of ``capacity`` positions (batch 1), drafting with the target's
    embedding weight and lm_head module."""

    blocks = True  # how a round tells it from EAGLE-3's runner

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: nn.Module, capacity: int):
        self.drafter, self.capacity = drafter, capacity
        self.config = config = drafter.config
        param = drafter.fc.weight
        self.device, self.dtype = param.device, param.dtype
        self.embed = embed.to(self.device, self.dtype)
        self._head = vocab_head(lm_head)  # the target's, on its device and in its dtype (the drafter's)
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in drafter.layers]
        self.length = 0  # committed positions, as the host last saw them
        self._slots = torch.arange(capacity, device=self.device)
        self._offsets = torch.arange(config.block_size, device=self.device)
        self._own = torch.ones(config.block_size, dtype=torch.bool, device=self.device)
        self._mask_tokens = torch.full((config.block_size - 1,), config.mask_token_id, device=self.device)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def layer_ids(self) -> list[int]:
        """The target's taps the drafter reads (eyas ids): the target runner captures these."""
        return self.config.layer_ids

    def reset(self) -> None:
        """Forget every committed position (a new prompt)."""
        self.length = 0

    @torch.no_grad()
    def commit_prompt(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Commit a prompt's target states ``aux`` [1, n, A·Ht] at ``positions`` [1, n] (the tokens after them are not
        needed: a block's context is the states alone)."""
        n = aux.shape[1]
        if self.length + n > self.capacity:
            raise ValueError(f"the drafter cache holds {self.capacity} positions, {self.length + n} needed")
        self.commit(aux.to(self.device), positions.to(self.device))
        self.length += n

    def commit(self, aux: torch.Tensor, positions: torch.Tensor) -> None:
        """Each layer's context keys and values of target states ``aux`` [1, n, A·Ht] of consecutive positions from
        ``positions``' first [1, n], written there. (A round's later positions repeat its last valid one as padding:
        written from the first, the rows past the valid ones land after them, where the next block masks them, and no
        slot is written twice.)"""
        positions = positions[:, :1] + self._slots[: aux.shape[1]]
        context = self.drafter.context(aux.to(self.dtype))
        for (keys, values), (k, v) in zip(self.cache, self.drafter.context_kv(context, positions), strict=True):
            keys.index_copy_(2, positions[0], k)
            values.index_copy_(2, positions[0], v)

    def propose(self, root: torch.Tensor, anchor: torch.Tensor, steps: int) -> torch.Tensor:
        """The block at position ``anchor`` [1] holding ``root`` [1] → its first ``steps`` greedy proposals, target
        ids [steps], in one forward: the cache's slots before ``anchor`` are its context."""
        return self.slot_logits(root, anchor, steps).argmax(-1)

    def slot_logits(self, root: torch.Tensor, anchor: torch.Tensor, steps: int) -> torch.Tensor:
        """The logits of the block's first ``steps`` mask slots over the target's vocabulary [steps, V]."""
        tokens = torch.cat([root, self._mask_tokens]).view(1, -1)
        positions = (anchor + self._offsets).view(1, -1)
        mask = torch.cat([self._slots < anchor, self._own]).expand(self.config.block_size, -1)
        hidden = self.drafter.block_hidden(F.embedding(tokens, self.embed), positions, self.cache, mask)
        return self._head(hidden[:, 1 : steps + 1])[0]


def check_block_modes(modes: Iterable[Speculation], block_size: int, where: str) -> None:
    """A block drafter proposes one chain of up to block − 1 tokens a round: refuse a tree or a longer chain."""
    for mode in modes:
        if mode.mode != "chain" or mode.draft_length > block_size - 1:
            raise EyasError(f"--mode {mode.label()}: {where} is a DFlash block drafter (block {block_size}), which proposes "
                            f"one chain of up to {block_size - 1} tokens a round: use chain:K with K ≤ {block_size - 1} "
                            f"(chain:{block_size - 1}: the whole block)")
