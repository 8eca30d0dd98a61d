"""Training-time test: unroll the drafter on its own outputs, as it will run when drafting.

At step k (k = 0 … K−1) position i is the drafter drafting k steps ahead of the last real position i:
  - its hidden is fc(target states at i) at step 0, then its own pre-norm output of step k−1 at i;
  - its token is the sequence's token i+1+k (the input ids shifted left by 1+k);
  - its RoPE position is i + k;
  - it attends to the step-0 keys of positions ≤ i (real target features, causal, padding excluded)
    and to its own earlier steps' keys at the same position i — exactly the keys a chained draft from
    prefix 0…i has in its cache. :func:`eyas.drafter.step.greedy_chain` is pinned to these logits.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from eyas.drafter.model import Eagle3Drafter


def shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, by:] padded at the end with ``fill`` to the same length (dim 1)."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def ttt_steps(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor,
              steps: int) -> Iterator[torch.Tensor]:
    """Yield the draft logits [B, T, Vd] of steps 0 … steps−1 (see the module docstring for their meaning).

    ``aux`` [B, T, k·Ht] target states, ``input_ids`` [B, T], ``valid`` [B, T] (True on real tokens;
    batches are right-padded). Sequences of a batch never attend to each other.
    """
    batch, tokens = input_ids.shape
    device = input_ids.device
    positions = torch.arange(tokens, device=device).expand(batch, tokens)
    index = torch.arange(tokens, device=device)
    causal = index[None, :] <= index[:, None]  # [query, key]
    # Real-feature keys: causal, padding keys hidden (a padding query still sees itself: no empty rows).
    real_keys = (causal[None] & (valid[:, None, :] | torch.eye(tokens, dtype=torch.bool, device=device)[None]))[:, None]
    own_keys = torch.eye(tokens, dtype=torch.bool, device=device).expand(batch, 1, tokens, tokens)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    hidden = drafter.fc(aux)
    for k in range(steps):
        mask = torch.cat([real_keys, *([own_keys] * k)], dim=-1)

        def attend(q, key, value, mask=mask):
            keys.append(key)
            values.append(value)
            return F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask)

        hidden = drafter.layer(hidden, shift_left(input_ids, 1 + k), positions + k, attend)
        yield drafter.logits(hidden)
