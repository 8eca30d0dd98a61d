"""A prompt's eager prefill without a [P, P] mask: SDPA's causal kernels over the prompt alone.

The engine hands every forward an explicit 4D mask, which is what trees and the slot cache need. A prefill from an
empty cache needs none: its keys are exactly the prompt's, and plain causal attention is what the mask says. Built
explicitly, the mask costs P² memory and time (an 8,192-token prompt: a 0.5 GB index matrix, a 134 MB bf16 mask, for
Kimi-K2.5's 131 k window far more than the cache itself), and it keeps SDPA off its flash kernels, which take no mask.

:func:`causal_prefill` switches a model's SDPA attention, for the length of a ``with`` block, to a function that ignores
the mask it is handed (the engine passes :func:`no_mask`'s 4D placeholder, which transformers forwards untouched) and asks
transformers' own SDPA attention for causal attention; a call it cannot serve so — keys that are not the queries' own
(a cache with earlier tokens), or options beyond a mask (softcap, sinks, position bias) — gets the causal mask built
for that call. Targets that slide a window or run another attention implementation keep the explicit mask
(:func:`serves`).
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.engine.attention import BEYOND_A_MASK, sdpa_replaced

NAME = "eyas_causal_prefill"


def no_mask(device: torch.device) -> torch.Tensor:
    """The placeholder passed as the attention mask: 4D, so transformers hands it to attention as it is."""
    return torch.zeros(1, 1, 1, 1, device=device)


def serves(model: nn.Module, sliding_window: int | None) -> bool:
    """Whether a prefill of ``model`` may run :func:`causal_prefill`: its attention is SDPA and nothing slides."""
    return sliding_window is None and getattr(model.config, "_attn_implementation", None) == "sdpa"


def causal_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention signature: causal attention of the queries over keys of their own positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    n, width = query.shape[2], key.shape[2]
    if n == width and not any(kwargs.get(k) is not None for k in BEYOND_A_MASK):
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True,
                                      **kwargs)
    # the queries are the last n of the keys: each sees the keys up to its own
    seen = torch.ones(n, width, dtype=torch.bool, device=query.device).tril(width - n)
    mask = torch.zeros(n, width, dtype=query.dtype, device=query.device).masked_fill_(~seen, torch.finfo(query.dtype).min)
    return sdpa_attention_forward(module, query, key, value, mask[None, None], dropout=dropout, scaling=scaling, **kwargs)


def causal_prefill(model: nn.Module):
    """Within the block (a context manager), ``model``'s SDPA attention layers run :func:`causal_sdpa` (the caller
    checked :func:`serves`)."""
    return sdpa_replaced(model, NAME, causal_sdpa)
