"""The k largest entries of each row, in two small kernels on a GPU.

The drafter picks its ``top_k`` proposals from 32 k logits at every tree level. ``torch.topk`` does it
with a multi-block radix select of some twenty kernels, a noticeable share of a whole greedy tree round
on a GPU (the round traces in benchmarks/LOG.md). For a small k a radix select is the wrong tool: each
block of a row can keep its own k best in registers (k passes of a max), and one more program per row
picks the k best of those candidates.

``largest(x, k)`` → (values, indices), as ``x.topk(k, dim=-1)`` of a 2-D ``x``: values in descending
order. The Triton kernels run for CUDA tensors and small k, and break ties towards the lower index;
everything else (the CPU, the tests, k > 16) is ``torch.topk``, which leaves ties' order unspecified.
Either way the drafts may differ only where logits tie exactly, and any drafts are verified.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover — depends on the torch build
    triton = None

KERNEL_MAX_K = 16  # k passes per block: past this a radix select is the better tool
BLOCK = 1024  # entries a stage-1 program reduces; 32 programs per row of a 32 k vocabulary


def largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``x`` [rows, n] → (values [rows, k] in x's dtype,
    indices [rows, k] int64), descending. NaN is not supported."""
    if x.dim() != 2 or not 0 < k <= x.shape[1]:
        raise ValueError(f"largest() needs a 2-D input with at least k = {k} columns, got shape {tuple(x.shape)}")
    if triton is not None and x.is_cuda and k <= KERNEL_MAX_K:
        return _top_k_triton(x, k)
    return x.topk(k, dim=-1)


def _top_k_triton(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    x = x.contiguous()
    block = min(BLOCK, triton.next_power_of_2(n))
    blocks = triton.cdiv(n, block)
    candidates = blocks * k
    cand_values = torch.empty(rows, candidates, dtype=torch.float32, device=x.device)
    cand_indices = torch.empty(rows, candidates, dtype=torch.int64, device=x.device)
    _block_top_k[(rows, blocks)](x, cand_values, cand_indices, n, K=k, BLOCK=block)
    values = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    _merge_top_k[(rows,)](cand_values, cand_indices, values, indices, candidates, K=k,
                          CANDIDATES=triton.next_power_of_2(candidates))
    return values, indices


if triton is not None:

    @triton.jit
    def _block_top_k(x_ptr, values_ptr, indices_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, block): the K best of its BLOCK entries, best first, ties to the lower index;
        a block with fewer than K entries pads with (-inf, n)."""
        row, block = tl.program_id(0), tl.program_id(1)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        alive = offsets < n
        x = tl.load(x_ptr + row * n + offsets, mask=alive, other=float("-inf")).to(tl.float32)
        out = (row * tl.num_programs(1) + block) * K
        for i in tl.static_range(K):
            best = tl.max(tl.where(alive, x, float("-inf")), 0)
            at = tl.min(tl.where(alive & (x == best), offsets, n), 0)  # n: nothing left in this block
            tl.store(values_ptr + out + i, best)
            tl.store(indices_ptr + out + i, at.to(tl.int64))
            alive = alive & (offsets != at)

    @triton.jit
    def _merge_top_k(values_ptr, indices_ptr, out_values_ptr, out_indices_ptr, candidates, K: tl.constexpr,
                     CANDIDATES: tl.constexpr):
        """Program (row): the K best of the row's block candidates, best first, ties to the lower index."""
        row = tl.program_id(0)
        slots = tl.arange(0, CANDIDATES)
        present = slots < candidates
        values = tl.load(values_ptr + row * candidates + slots, mask=present, other=float("-inf"))
        indices = tl.load(indices_ptr + row * candidates + slots, mask=present, other=0)
        alive = present  # a block's padding (-inf, n) ranks after every real entry, -inf ones included
        for i in tl.static_range(K):
            best = tl.max(tl.where(alive, values, float("-inf")), 0)
            at = tl.min(tl.where(alive & (values == best), indices, 2**62), 0)
            tl.store(out_values_ptr + row * K + i, best.to(out_values_ptr.dtype.element_ty))
            tl.store(out_indices_ptr + row * K + i, at)
            alive = alive & (indices != at)
