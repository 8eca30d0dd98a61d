"""A training-time-test step's attention without computing masked scores: real keys by a causal flash kernel, own
keys one dot product each, the two merged by their log-sum-exp.

At TTT step k ≥ 1 a query at position i sees the step-0 ("real") keys of positions ≤ i and its own k keys of steps
1 … k at position i (eyas.families.eagle3.ttt). One softmax over both sets:

    lse_i   = log(exp(lse_real_i) + Σ_j exp(s_ij))            s_ij = q_i · own_k_ij · scale
    out_i   = exp(lse_real_i − lse_i) · out_real_i + Σ_j exp(s_ij − lse_i) · own_v_ij

where out_real, lse_real are the causal flash kernel's output and log-sum-exp over the real keys alone. The work is
the causal half of T² plus k·T dot products, where one attention over [real ‖ own keys] under a mask computes all
(k+1)·T² scores.

The backward uses the flash kernel's own backward over the real keys, handed the *merged* output and log-sum-exp:
it recomputes P_ij = exp(S_ij − lse_i), the merged softmax's probabilities of the real keys, and
D_i = Σ dO_i ⊙ out_i, the merged softmax's correction term, so its dq, dk, dv are exactly the real keys' share of the
merged attention's gradients (the identity ring attention relies on). The own keys' share is written out below.
"""

from __future__ import annotations

import torch


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal flash attention: (out [B, h, T, d], log-sum-exp [B, h, T] float32, what its backward needs)."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, None


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the real keys alone (TTT step 0), [B, h, T, d]. On CUDA in half precision it is the flash
    kernel the later steps use, called by name: SDPA's own choice there was cuDNN's, which builds a plan for every batch
    shape it has not seen (0.11 s forward, 0.09 s backward on an H100: 2026-12-07_h100_stream-trace), and
    length-bucketed batches bring new shapes all through a run: 8 of the 40 steps after the 40th of the demo's."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_forward(q, k, v, q.shape[-1] ** -0.5)[0]  # autograd records the op's own backward
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _flash_backward(grad: torch.Tensor, q, k, v, out, lse, extra, scale: float):
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in the precision the merge is done in: float32, or float64 for float64 inputs (the tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _own_scores(q: torch.Tensor, own_k: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    """s [B, h, T, k], widened: each query against its own position's key of each later step ([B, h, T, d] each)."""
    return torch.stack([(q * key).sum(-1, dtype=_wide(q).dtype) for key in own_k], dim=-1) * scale


class SplitAttention(torch.autograd.Function):
    """softmax over (causal real keys ∪ each own key at the query's position) · values, [B, h, T, d].

    Inputs: q, real_k, real_v, then the k own keys and the k own values (each [B, h, T, d]) as separate arguments:
    nothing is stacked, so the unroll keeps no copy of them beside the tensors themselves."""

    @staticmethod
    def forward(ctx, q, real_k, real_v, *own):
        own_k, own_v = own[: len(own) // 2], own[len(own) // 2:]
        scale = q.shape[-1] ** -0.5
        real_out, real_lse, extra = _flash_forward(q, real_k, real_v, scale)
        scores = _own_scores(q, own_k, scale)
        lse = torch.logaddexp(real_lse, scores.logsumexp(-1))
        merged = _wide(real_out) * torch.exp(real_lse - lse).unsqueeze(-1)
        for j, value in enumerate(own_v):
            merged = merged + torch.exp(scores[..., j] - lse).unsqueeze(-1) * _wide(value)
        out = torch.empty_like(real_out).copy_(merged)  # the kernel's memory layout, which its backward expects
        ctx.save_for_backward(q, real_k, real_v, out, lse, scores, *own)
        ctx.extra, ctx.scale = extra, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, real_k, real_v, out, lse, scores, *own = ctx.saved_tensors
        own_k, own_v = own[: len(own) // 2], own[len(own) // 2:]
        scale = ctx.scale
        grad = torch.empty_like(out).copy_(grad)
        dq, dk, dv = _flash_backward(grad, q, real_k, real_v, out, lse, ctx.extra, scale)
        dq = _wide(dq)
        correction = (_wide(grad) * _wide(out)).sum(-1)  # D_i
        d_own_k, d_own_v = [], []
        for j, (key, value) in enumerate(zip(own_k, own_v, strict=True)):
            p = torch.exp(scores[..., j] - lse)  # the merged softmax's weight of own key j
            dp = (grad * value).sum(-1, dtype=p.dtype)
            ds = (p * (dp - correction) * scale).unsqueeze(-1)  # dL/ds_ij, the scale of s folded in
            dq = dq + ds * _wide(key)
            d_own_k.append((ds * _wide(q)).to(key.dtype))
            d_own_v.append((p.unsqueeze(-1) * _wide(grad)).to(value.dtype))
        return (dq.to(q.dtype), dk, dv, *d_own_k, *d_own_v)


def attend_split(q: torch.Tensor, real_k: torch.Tensor, real_v: torch.Tensor, own_k: list[torch.Tensor],
                 own_v: list[torch.Tensor]) -> torch.Tensor:
    """eyas.families.eagle3.ttt.attend_real_and_own's result: ``real_*`` [B, h, T, d] step 0's keys and values, ``own_*`` one
    [B, h, T, d] per later step, the current one included."""
    return SplitAttention.apply(q, real_k, real_v, *own_k, *own_v)
