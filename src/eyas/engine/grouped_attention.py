"""One-token attention for grouped-query HF targets without copying keys: the batched decoder's attention.

transformers' SDPA attention (before 5.2x) repeats every key and value head once per query head sharing it
whenever a mask is given, so a batched decoding step with a padding mask writes and reads the whole visible
cache ``heads / kv_heads`` times over. For the demo target at batch 512 that copy was the step: 112 ms per
step on an H200 (benchmarks/LOG.md, "Regenerating ShareGPT for the release, second part"). Here a one-token
query instead attends as ``[B, kv_heads, group, head_dim]`` — the query heads of each key head become that
head's rows — against the cache as it is; every other call is transformers' own SDPA attention.

On a CUDA GPU with Triton the grouped call runs :func:`one_token_attention`, one program per (row, key head)
walking the visible cache in blocks with an online softmax (flash-decoding without the split: a batch of hundreds
of rows has programs enough to fill the GPU). SDPA's kernels tile the queries 64 or more at a time, and here each
key head has only ``heads / kv_heads`` of them; elsewhere (the CPU) the grouped SDPA call runs.

:func:`grouped_attention` switches a model to it for the duration of a ``with`` block (CUDA graphs recorded
inside keep it when replayed later).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.engine.attention import BEYOND_A_MASK, kernels_available, sdpa_replaced

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover — depends on the torch build
    triton = None

NAME = "eyas_grouped_sdpa"
BLOCK_SLOTS = 64  # cache slots a program scores at once


def one_token_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
    """query [B, H, 1, d], key/value [B, Hkv, S, d] (any slot stride), additive mask [B or 1, 1, 1, ≥ S] →
    [B, 1, H, d], or None where the kernel does not apply (no Triton, an odd head size, values of another width than
    keys as MLA has, more than 16 query heads per key head, an unusual layout): the caller then runs SDPA. Query
    head h reads key head h // (H / Hkv)."""
    batch, heads, length, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    if (triton is None or length != 1 or heads % kv_heads or group > 16 or dim not in (32, 64, 128)
            or value.shape[-1] != dim or mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[-1] < slots
            or mask.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1):
        return None
    query = query.contiguous()
    out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
    _one_token[(batch * kv_heads,)](
        query, key, value, mask, out, slots, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0) if mask.shape[0] > 1 else 0,
        KV_HEADS=kv_heads, GROUP=group, ROWS=16, DIM=dim, BLOCK=BLOCK_SLOTS)
    return out


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function with transformers' signature (query [B, H, n, d], key/value [B, Hkv, S, d], additive
    mask [B, 1, n, S]) → ([B, n, H, d], None): one-token queries grouped per key head, the rest as transformers'."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if length != 1 or groups == 1 or heads % kv_heads or any(kwargs.get(k) is not None for k in BEYOND_A_MASK):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if (attention_mask is not None and kernels_available(query.device) and not (module.training and dropout)
            and (out := one_token_attention(query, key, value, attention_mask, scaling or dim ** -0.5)) is not None):
        return out, None
    # query head h reads key head h // groups (transformers' repeat_kv order), so [B, H, 1, d] regroups by a view
    rows = query.reshape(batch, kv_heads, groups, dim)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]  # [B, 1, 1, S] broadcasts
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)
    return out.reshape(batch, 1, heads, dim), None  # [B, Hkv, G, d] → [B, 1, H, d]: the same head order


def grouped_attention(model: nn.Module):
    """Within the block (a context manager), every attention layer of ``model`` that runs transformers' SDPA runs
    :func:`grouped_sdpa` instead; yields whether any does (eager or other implementations are left alone)."""
    return sdpa_replaced(model, NAME, grouped_sdpa)


if triton is not None:

    @triton.jit
    def _one_token(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, slots, scale,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_mb,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
                   BLOCK: tl.constexpr):
        """Program (row b, key head kv): the GROUP query heads of kv (rows of a 16-row tile: tl.dot's least) against
        slots [0, slots) of row b's cache, BLOCK at a time, with the running maximum and sum of an online softmax."""
        b, kv = tl.program_id(0) // KV_HEADS, tl.program_id(0) % KV_HEADS
        rows = tl.arange(0, ROWS)
        row_ok = rows < GROUP
        head = kv * GROUP + rows
        dims = tl.arange(0, DIM)
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
        maximum = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        scale32 = tl.cast(scale, tl.float32)
        for start in range(0, slots, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            slot_ok = slot < slots
            k = tl.load(k_ptr + b * stride_kb + kv * stride_kh + slot[:, None] * stride_ks + dims[None, :],
                        mask=slot_ok[:, None], other=0.0)
            v = tl.load(v_ptr + b * stride_vb + kv * stride_vh + slot[:, None] * stride_vs + dims[None, :],
                        mask=slot_ok[:, None], other=0.0)
            bias = tl.load(mask_ptr + b * stride_mb + slot, mask=slot_ok, other=float("-inf")).to(tl.float32)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale32 + bias[None, :]
            new = tl.maximum(maximum, tl.max(scores, 1))
            finite = tl.where(new == float("-inf"), 0.0, new)  # nothing visible yet: every weight 0
            weights = tl.exp(scores - finite[:, None])
            rescale = tl.exp(maximum - finite)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v).to(tl.float32)
            maximum = new
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + (b * KV_HEADS * GROUP + head)[:, None] * DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
