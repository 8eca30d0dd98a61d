"""The drafter side: a preallocated KV cache with committed and speculative parts.

Positions whose target states are known (the prompt, then each round's accepted tokens) are
*committed*: they stay. Drafting steps after them are *speculative*: each round's steps see one
another, and ``rollback`` drops them all before the next round commits what the target accepted.
The layer itself is :meth:`Eagle3Drafter.layer`, the same code training runs (only attention differs),
and the chained step is :mod:`eyas.drafter.step`'s rule: hidden = previous pre-norm output, token =
previous draft mapped to a target id, position + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.drafter.model import Eagle3Drafter


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
        self.d2t_host = drafter.d2t.cpu()  # draft → target id offsets for host-side bookkeeping (trees)
        self.length = 0  # committed positions
        self.speculative = 0  # drafted positions after them, visible until rollback
        self._commit = False
        self._speculative_mask: torch.Tensor | None = None

    def reset(self) -> None:
        self.length = self.speculative = 0

    def rollback(self) -> None:
        """Forget this round's drafted positions."""
        self.speculative = 0

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[2]
        start = self.length + self.speculative
        if start + n > self.capacity:
            raise ValueError(f"the drafter cache holds {self.capacity} positions, {start + n} needed")
        self.keys[:, :, start : start + n] = k
        self.values[:, :, start : start + n] = v
        visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
        if self._speculative_mask is not None:  # a tree: which drafted entries (and new ones) each query sees
            visible[:, self.length :] = self._speculative_mask.to(self.device)
        else:  # a chain: every drafted entry, the new ones causally
            visible[:, start:] = visible[:, start:].tril()
        if self._commit:
            self.length += n
        else:
            self.speculative += n
        return F.scaled_dot_product_attention(q, self.keys[:, :, : start + n], self.values[:, :, : start + n], attn_mask=visible)

    @torch.no_grad()
    def extend(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, commit: bool) -> torch.Tensor:
        """Run the layer on ``hidden`` [1, n, H] and tokens [1, n] → pre-norm outputs [1, n, H]; the new
        positions see everything cached and each other causally."""
        self._commit, self._speculative_mask = commit, None
        return self.drafter.layer(hidden, token_ids.to(self.device), positions.to(self.device), self._attend)

    @torch.no_grad()
    def extend_tree(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                    speculative_mask: torch.Tensor) -> torch.Tensor:
        """Draft n tree nodes at once: ``speculative_mask`` [n, drafted + n] says which drafted entries
        (in the order written) and which new nodes each sees; committed positions are always seen."""
        self._commit, self._speculative_mask = False, speculative_mask
        try:
            return self.drafter.layer(hidden, token_ids.to(self.device), positions.to(self.device), self._attend)
        finally:
            self._speculative_mask = None

    @torch.no_grad()
    def draft_chain(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, steps: int) -> torch.Tensor:
        """Commit the target states ``aux`` [1, n, k·Ht] (each with the token after it, [1, n]) and
        draft ``steps`` tokens greedily after them → target ids [steps]."""
        self.rollback()
        prenorm = self.extend(self.drafter.fc(aux.to(self.device, self.dtype)), next_tokens, positions, commit=True)[:, -1:]
        position = positions[:, -1:].to(self.device)
        drafted = []
        for step in range(steps):
            token = self.drafter.to_target_ids(self.drafter.logits(prenorm).argmax(-1))  # [1, 1]
            drafted.append(token)
            if step + 1 < steps:
                position = position + 1
                prenorm = self.extend(prenorm, token, position, commit=False)
        self.rollback()
        return torch.cat(drafted, dim=1)[0]
