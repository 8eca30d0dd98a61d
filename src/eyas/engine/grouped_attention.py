"""One-token attention for grouped-query HF targets without copying keys: the batched decoder's attention.

transformers' SDPA attention (before 5.2x) repeats every key and value head once per query head sharing it
whenever a mask is given, so a batched decoding step with a padding mask writes and reads the whole visible
cache ``heads / kv_heads`` times over. For the demo target at batch 512 that copy was the step: 112 ms per
step on an H200 (benchmarks/LOG.md, "Regenerating ShareGPT for the release, second part"). Here a one-token
query instead attends as ``[B, kv_heads, group, head_dim]`` — the query heads of each key head become that
head's rows — against the cache as it is; every other call is transformers' own SDPA attention.

:func:`grouped_attention` switches a model to it for the duration of a ``with`` block (CUDA graphs recorded
inside keep it when replayed later).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

NAME = "eyas_grouped_sdpa"
# keyword arguments that change what attention computes beyond a mask: those calls stay with transformers
_SPECIAL = ("softcap", "s_aux", "sinks", "position_bias")


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
    if length != 1 or groups == 1 or heads % kv_heads or any(kwargs.get(k) is not None for k in _SPECIAL):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # query head h reads key head h // groups (transformers' repeat_kv order), so [B, H, 1, d] regroups by a view
    rows = query.reshape(batch, kv_heads, groups, dim)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]  # [B, 1, 1, S] broadcasts
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)
    return out.reshape(batch, 1, heads, dim), None  # [B, Hkv, G, d] → [B, 1, H, d]: the same head order


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_sdpa)


@contextmanager
def grouped_attention(model: nn.Module) -> Iterator[bool]:
    """Within the block, every attention layer of ``model`` that runs transformers' SDPA runs :func:`grouped_sdpa`
    instead; yields whether any does (eager or other implementations are left alone)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == "sdpa"}
    if configs:
        _register()
    for config in configs.values():
        config._attn_implementation = NAME
    try:
        yield bool(configs)
    finally:
        for config in configs.values():
            config._attn_implementation = "sdpa"
