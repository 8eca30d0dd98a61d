"""A reference drafter loop for the tests: chained drafting step by step, as plainly as it can be written.

``prefill`` runs the layer over positions whose target states are known (hidden = fc(aux)), causally,
and fills a growing cache. ``step`` then chains: its hidden is the previous pre-norm output, its token the
previous draft (as a target id), at the next position, attending to everything cached plus itself.
The training-time test (:mod:`eyas.families.eagle3.ttt`) must give exactly these logits, and the engine's drafter
(:mod:`eyas.families.eagle3.runner`) must draft these tokens: tests pin both to this reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eyas.families.eagle3.model import Eagle3Drafter


@dataclass
class DraftCache:
    """Keys and values of every position drafted or prefilled so far: [B, h, S, d] each."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """New queries see every cached key and the new keys causally; the new keys are then cached."""
        past = sum(x.shape[2] for x in self.keys)
        new = q.shape[2]
        keys = torch.cat([*self.keys, k], dim=2)
        values = torch.cat([*self.values, v], dim=2)
        allowed = torch.ones(new, past + new, dtype=torch.bool, device=q.device)
        allowed[:, past:] = torch.ones(new, new, dtype=torch.bool, device=q.device).tril()
        self.keys.append(k)
        self.values.append(v)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)


def prefill(drafter: Eagle3Drafter, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
            cache: DraftCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions with real target states: aux [B, n, k·Ht], the token after each [B, n] → (logits, pre-norm)."""
    prenorm = drafter.layer(drafter.fuse(aux), next_tokens, positions, cache.attend)
    return drafter.logits(prenorm), prenorm


def step(drafter: Eagle3Drafter, prenorm: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
         cache: DraftCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One chained step: the previous pre-norm output [B, 1, H] and drafted target ids [B, 1]."""
    out = drafter.layer(prenorm, tokens, positions, cache.attend)
    return drafter.logits(out), out


def greedy_chain(
    drafter: Eagle3Drafter, aux: torch.Tensor, tokens: torch.Tensor, steps: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Draft ``steps`` tokens greedily after a prefix: aux [B, P, k·Ht] for positions 0..P-1 and the tokens
    after them [B, P]. Returns per step the logits at the drafting position and the drafted target ids."""
    batch, length = tokens.shape
    cache = DraftCache()
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    logits, prenorm = prefill(drafter, aux, tokens, positions, cache)
    logits, prenorm = logits[:, -1:], prenorm[:, -1:]
    all_logits, drafted = [logits[:, 0]], []
    for k in range(1, steps + 1):
        token = drafter.to_target_ids(logits.argmax(-1))
        drafted.append(token[:, 0])
        if k == steps:
            break
        logits, prenorm = step(drafter, prenorm, token, torch.full((batch, 1), length - 1 + k, device=tokens.device), cache)
        all_logits.append(logits[:, 0])
    return all_logits, drafted
