"""Training-time test: unroll the drafter on its own outputs, as it will run when drafting.

At step k (k = 0 … K−1) position i is the drafter drafting k steps ahead of the last real position i:
  - its hidden is fc(target states at i) at step 0, then its own pre-norm output of step k−1 at i;
  - its token is the sequence's token i+1+k (the input ids shifted left by 1+k);
  - its RoPE position is i + k;
  - it attends to the step-0 keys of positions ≤ i (real target features, causal) and to its own
    earlier steps' keys at the same position i — exactly the keys a chained draft from prefix 0…i has
    in its cache. The tests pin the engine's drafting and a step-by-step reference to these logits.

Batches are right-padded, so causal attention alone keeps a real position away from padding; what a
padding position computes is never read by a real one (its own keys sit at its own position).

Attention at step k is one softmax over T causal scores plus k "own" scores. Three ways to compute it,
equal up to rounding (tests pin them together), named by ``attention``:
  - "concat": one fused ``scaled_dot_product_attention`` over [real keys ‖ each step's own keys]
    under a [T, (k+1)·T] mask: k+1 times the keys, most of them masked, but the kernel (cuDNN)
    never writes the scores to memory, which makes a training step faster than writing the scores out
    (``benchmarks/train_profile.py`` measures both);
  - "split": a causal flash kernel over the real keys and one dot product per own key, merged by their
    log-sum-exp (eyas.families.eagle3.split_attention): no masked score is computed at all; the default on a GPU
    (CUDA_ATTENTION): on an H200 it trained 1.86× concat's tokens/s at the demo target's widths and 1.40× at
    Kimi-K2.5's (benchmarks/LOG.md, "The released drafter" and "Kimi-K2.5 scale … split attention");
  - "scores": the scores as they are: the real keys' [B, h, T, T] once and each earlier step's own
    key as one dot product per position; the default elsewhere. On a CPU, SDPA with a mask
    materialises every masked score, so the concatenation would cost k+1 times the work and memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from eyas.families.eagle3.model import Eagle3Drafter
from eyas.families.eagle3.split_attention import attend_causal, attend_split

ATTENTION = ("scores", "concat", "split")
CUDA_ATTENTION = "split"  # how steps after the first attend on a GPU (benchmarks/kimi_scale.py --attention concat,split measures them)


def shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, by:] padded at the end with ``fill`` to the same length (dim 1)."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def attend_real_and_own(q: torch.Tensor, real_k: torch.Tensor, real_v: torch.Tensor, own_k: list[torch.Tensor],
                        own_v: list[torch.Tensor], future: torch.Tensor) -> torch.Tensor:
    """softmax over (causal real keys ∪ each own key at the query's position) · values, [B, h, T, d].

    ``real_*`` [B, h, T, d] are step 0's keys and values; ``own_*`` hold one [B, h, T, d] per later
    step, the current one included; ``future`` [T, T] is True above the diagonal (keys a query
    must not see).
    """
    tokens = q.shape[2]
    scale = q.shape[-1] ** -0.5
    real_scores = (q @ real_k.transpose(-1, -2) * scale).masked_fill(future, float("-inf"))
    own_keys, own_values = torch.stack(own_k, dim=3), torch.stack(own_v, dim=3)  # [B, h, T, k, d]
    own_scores = (q.unsqueeze(3) * own_keys).sum(-1) * scale  # [B, h, T, k]
    weights = torch.softmax(torch.cat([real_scores, own_scores.to(real_scores.dtype)], dim=-1), dim=-1)
    real_part = weights[..., :tokens].to(real_v.dtype) @ real_v
    own_part = (weights[..., tokens:].unsqueeze(-1) * own_values).sum(3)
    return (real_part + own_part).to(q.dtype)


def attend_fused(q: torch.Tensor, real_k: torch.Tensor, real_v: torch.Tensor, own_k: list[torch.Tensor],
                 own_v: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """:func:`attend_real_and_own` as one fused attention over [real keys ‖ own keys of each step] under
    ``mask`` [T, (k+1)·T] = [causal ‖ diagonal × k] (True where a query may see a key)."""
    keys, values = torch.cat([real_k, *own_k], dim=2), torch.cat([real_v, *own_v], dim=2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def ttt_steps(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, steps: int,
              attention: str | None = None) -> Iterator[torch.Tensor]:
    """Yield the draft logits [B, T, Vd] of steps 0 … steps−1 (see the module docstring for their meaning).

    ``aux`` [B, T, k·Ht] target states, ``input_ids`` [B, T], right-padded rows. Sequences of a batch
    never attend to each other. ``attention``: how steps after the first attend, one of ATTENTION (module
    docstring); None = CUDA_ATTENTION on CUDA, "scores" elsewhere.
    """
    batch, tokens = input_ids.shape
    device = input_ids.device
    attention = attention or (CUDA_ATTENTION if device.type == "cuda" else "scores")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTION)}")
    fused = attention == "concat"
    positions = torch.arange(tokens, device=device).expand(batch, tokens)
    future = torch.ones(tokens, tokens, dtype=torch.bool, device=device).triu(1)  # one mask for every step
    own = torch.eye(tokens, dtype=torch.bool, device=device) if fused else None
    fused_mask = ~future if fused else None  # the fused path's [causal ‖ diagonal × k]: one diagonal block more each step
    real: list[torch.Tensor] = []  # step 0's keys and values
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    hidden = drafter.fuse(aux)
    for k in range(steps):
        if fused and k > 0:
            fused_mask = torch.cat([fused_mask, own], dim=-1)

        def attend(q, key, value, first=k == 0, mask=fused_mask):
            if first:  # real features only: plain causal attention (the flash kernel on a GPU)
                real.extend((key, value))
                return attend_causal(q, key, value)
            own_k.append(key)
            own_v.append(value)
            if attention == "concat":
                return attend_fused(q, real[0], real[1], own_k, own_v, mask)
            if attention == "split":
                return attend_split(q, real[0], real[1], own_k, own_v)
            return attend_real_and_own(q, real[0], real[1], own_k, own_v, future)

        hidden = drafter.layer(hidden, shift_left(input_ids, 1 + k), positions + k, attend)
        yield drafter.logits(hidden)
