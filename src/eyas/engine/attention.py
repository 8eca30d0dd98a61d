"""Decode-time attention over the static cache, split across the cache, in two Triton kernels.

A verify step's attention is a few dozen queries against a few hundred cache slots: tiny work, all
latency. SDPA's cuDNN kernel gives each query head one program that walks the whole cache (9
programs for the demo target), after the key and value heads are copied once per query head, with two
copies and a memset around it. Here instead:

- one program per (key head, block of 64 slots, tile of query rows): the queries of every query head
  sharing that key head are the rows (no key or value copy), scored against the block with the
  additive mask added, giving a partial output, its row maxima and row sums;
- one program per (key head, tile of rows) merges the blocks' partials (the usual log-sum-exp
  rescaling) and writes the output in the layout o_proj reads, [n, heads·head_dim].

The mask is the engine's additive mask [n, slots], so any visibility works (committed prefix, chain,
tree, sliding window). ``attend`` returns None where the kernels do not apply (no Triton, not CUDA, too
many query rows, an odd head size, a GPU older than compute capability 8.0); the caller then runs SDPA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover — depends on the torch build
    triton = None

BLOCK_SLOTS = 64
# Query rows (query heads per key head × tokens) per program, and per merging program: the tiling
# benchmarks/attention_tiles_gpu.py found fastest (its figures are in benchmarks/LOG.md). The merge is the
# slow half (it loops over every block), so more programs with fewer rows each win. Up to 192 rows (61 tokens
# of a 3-query-head group, the most measured) run here; more go to SDPA.
TILE_ROWS = 64
MERGE_ROWS = 16
MAX_ROWS = 192


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``visible`` [n, S] (or [B, n, S]) bool → the additive mask [1, 1, n, S] ([B, 1, n, S]) SDPA and
    :func:`attend` read: 0 where a query sees a slot, the dtype's lowest value where not."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None] if mask.dim() == 2 else mask[:, None]


def sliding_rule(config) -> tuple[int | None, bool]:
    """(window, whether every layer slides) of a text config, as its HF forward applies them: the layers typed
    "sliding_attention" slide (Gemma 3, Qwen2 with use_sliding_window), or — when a model has a window but no
    layer types (Mistral, Mixtral) — all of them; (None, False) when none does."""
    types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if window is None or not ("sliding_attention" in types or not types):
        return None, False
    return window, not types


def layer_masks(visible: torch.Tensor, near: torch.Tensor | None, everywhere: bool, dtype: torch.dtype):
    """The additive mask(s) a forward takes from ``visible`` (bool, [n, S] or [B, n, S]): one tensor, or one per
    layer type when only some layers slide; ``near`` (same shape, or broadcastable): the slots within the window."""
    if near is None:
        return additive_mask(visible, dtype)
    if everywhere:
        return additive_mask(visible & near, dtype)
    return {"full_attention": additive_mask(visible, dtype), "sliding_attention": additive_mask(visible & near, dtype)}


# keyword arguments of transformers' attention functions that change what attention computes beyond a mask
BEYOND_A_MASK = ("softcap", "s_aux", "sinks", "position_bias")


@contextmanager
def sdpa_replaced(model: nn.Module, name: str, function) -> Iterator[bool]:
    """Within the block, every attention layer of ``model`` that runs transformers' SDPA runs ``function`` (transformers'
    attention signature, registered as ``name``) instead; yields whether any does (eager or other implementations are
    left alone). CUDA graphs recorded inside keep it when replayed later."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == "sdpa"}
    if configs:
        from transformers import AttentionInterface

        AttentionInterface.register(name, function)
    for config in configs.values():
        config._attn_implementation = name
    try:
        yield bool(configs)
    finally:
        for config in configs.values():
            config._attn_implementation = "sdpa"


def kernels_available(device: torch.device) -> bool:
    """Whether :func:`attend` runs on ``device``: Triton is installed and the GPU has bf16 matmuls (compute
    capability 8.0 or newer). Asked once, when a runner is built: not from inside a compiled step."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
           filled: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [1, H, n, d], keys/values [1, Hkv, S, d], mask additive [1, 1, n, S] → [1, n, H·d], or None
    where the kernels do not apply (the caller has checked :func:`kernels_available`; on the CPU only
    Triton's interpreter runs them, in the tests).

    ``filled``: a one-element integer tensor on the device, the slots in use (the committed length plus the
    step's own): no query sees a slot at or after it, whatever the mask says there. Blocks past it read
    no keys or values and are not merged, so the cost follows the filled length while the launch keeps
    the cache's shape — one recorded step serves every length."""
    if triton is None or not isinstance(mask, torch.Tensor):
        return None
    batch, heads, n, dim = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    tile = min(TILE_ROWS, max(16, triton.next_power_of_2(group * n)))  # tl.dot needs 16 rows at least
    tiles = triton.cdiv(group * n, tile)
    rows = tiles * tile
    if (batch != 1 or rows > MAX_ROWS or dim not in (32, 64, 128) or mask.shape != (1, 1, n, slots)
            or heads % kv_heads or keys.stride(-1) != 1 or values.stride() != keys.stride()):
        return None
    q = q.contiguous()
    mask = mask[0, 0]
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    blocks = triton.cdiv(slots, BLOCK_SLOTS)
    partial = torch.empty(kv_heads, blocks, rows, dim, dtype=torch.float32, device=q.device)
    maxima = torch.empty(kv_heads, blocks, rows, dtype=torch.float32, device=q.device)
    sums = torch.empty(kv_heads, blocks, rows, dtype=torch.float32, device=q.device)
    bounded = filled is not None
    filled = filled if bounded else mask  # unread without BOUNDED: any pointer
    _block_attention[(kv_heads, blocks, tiles)](
        q, keys, values, mask, partial, maxima, sums, filled, n, slots, rows, scale,
        q.stride(1), q.stride(2), keys.stride(1), keys.stride(2), mask.stride(0),
        GROUP=group, DIM=dim, TILE=tile, BLOCK=BLOCK_SLOTS, EXACT=q.dtype == torch.float32, BOUNDED=bounded)
    out = torch.empty(1, n, heads * dim, dtype=q.dtype, device=q.device)
    merge = min(MERGE_ROWS, rows)
    _merge_blocks[(kv_heads, triton.cdiv(rows, merge))](partial, maxima, sums, out, filled, n, blocks, rows,
                                                        GROUP=group, DIM=dim, TILE=merge, BLOCK=BLOCK_SLOTS,
                                                        BLOCKS=triton.next_power_of_2(blocks), BOUNDED=bounded)
    return out


if triton is not None:

    @triton.jit
    def _block_attention(q_ptr, k_ptr, v_ptr, mask_ptr, partial_ptr, maxima_ptr, sums_ptr, filled_ptr, n, slots,
                         rows_all, scale, stride_qh, stride_qn, stride_kh, stride_ks, stride_mn,
                         GROUP: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
                         EXACT: tl.constexpr, BOUNDED: tl.constexpr):
        """Program (key head, block, tile): rows r = (query head kv·GROUP + r // n, token r % n) of the tile
        against the block's slots → the unnormalised output, row maximum and row sum of exp(score − maximum).
        BOUNDED: slots from *filled_ptr on are not read (a block wholly past it: maximum −inf, sum 0)."""
        kv, block = tl.program_id(0), tl.program_id(1)
        rows = tl.program_id(2) * TILE + tl.arange(0, TILE)
        row_ok = rows < GROUP * n
        head, token = kv * GROUP + rows // n, rows % n
        dims = tl.arange(0, DIM)
        q = tl.load(q_ptr + head[:, None] * stride_qh + token[:, None] * stride_qn + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        slot = block * BLOCK + tl.arange(0, BLOCK)
        slot_ok = slot < slots
        if BOUNDED:
            slot_ok = slot_ok & (slot < tl.load(filled_ptr))
        at = kv * stride_kh + slot[:, None] * stride_ks + dims[None, :]
        k = tl.load(k_ptr + at, mask=slot_ok[:, None], other=0.0)
        v = tl.load(v_ptr + at, mask=slot_ok[:, None], other=0.0)
        bias = tl.load(mask_ptr + token[:, None] * stride_mn + slot[None, :], mask=row_ok[:, None] & slot_ok[None, :],
                       other=float("-inf")).to(tl.float32)
        if EXACT:  # fp32 inputs: no TF32 rounding
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k)).to(tl.float32)
        # torch.compile hands a Python float to a user kernel as fp64 (Triton's own launcher, as fp32): held
        # in fp64, the scale would turn the scores and weights fp64, and the fp32 dot below refuses them
        scores = scores * tl.cast(scale, tl.float32) + bias
        maximum = tl.max(scores, 1)
        finite = tl.where(maximum == float("-inf"), 0.0, maximum)  # a padding row: every weight 0
        weights = tl.exp(scores - finite[:, None])
        if EXACT:
            out = tl.dot(weights, v, input_precision="ieee")
        else:
            out = tl.dot(weights.to(v.dtype), v).to(tl.float32)
        base = (kv * tl.num_programs(1) + block) * rows_all
        tl.store(partial_ptr + (base + rows)[:, None] * DIM + dims[None, :], out)
        tl.store(maxima_ptr + base + rows, maximum)
        tl.store(sums_ptr + base + rows, tl.sum(weights, 1))

    @triton.jit
    def _merge_blocks(partial_ptr, maxima_ptr, sums_ptr, out_ptr, filled_ptr, n, blocks, rows_all, GROUP: tl.constexpr,
                      DIM: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                      BOUNDED: tl.constexpr):
        """Program (key head, tile of rows): every block's partial rescaled to the overall row maximum, summed
        and normalised, written as out[token, head·DIM + d]. BOUNDED: the blocks holding slots before *filled_ptr
        alone."""
        kv = tl.program_id(0)
        rows = tl.program_id(1) * TILE + tl.arange(0, TILE)
        row_ok = rows < GROUP * n
        dims = tl.arange(0, DIM)
        used = blocks
        if BOUNDED:
            used = tl.minimum(tl.cdiv(tl.load(filled_ptr).to(tl.int32), BLOCK), blocks)
        each = tl.arange(0, BLOCKS)
        at = (kv * blocks + each)[:, None] * rows_all + rows[None, :]
        maxima = tl.load(maxima_ptr + at, mask=(each < used)[:, None], other=float("-inf"))
        overall = tl.max(maxima, 0)
        overall = tl.where(overall == float("-inf"), 0.0, overall)
        sums = tl.load(sums_ptr + at, mask=(each < used)[:, None], other=0.0)
        total = tl.sum(sums * tl.exp(maxima - overall[None, :]), 0)
        acc = tl.zeros((TILE, DIM), dtype=tl.float32)
        for block in range(used):
            base = (kv * blocks + block) * rows_all
            weight = tl.exp(tl.load(maxima_ptr + base + rows) - overall)
            acc += tl.load(partial_ptr + (base + rows)[:, None] * DIM + dims[None, :]) * weight[:, None]
        head, token = kv * GROUP + rows // n, rows % n
        out = acc / tl.where(row_ok, total, 1.0)[:, None]
        heads = tl.num_programs(0) * GROUP
        tl.store(out_ptr + token[:, None] * (heads * DIM) + head[:, None] * DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
