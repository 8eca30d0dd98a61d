"""fp8 (e4m3) storage with a per-token, per-layer scale: half the bytes of bf16.

Each token's chunk of H values (one layer's state) is scaled so its largest magnitude maps to
e4m3's largest finite value (448), cast to e4m3, and the scale kept in float32. Hidden states
have a few huge outlier channels per token; a per-token-per-layer scale keeps the other channels
as precise as the format allows.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, chunks·H] → (e4m3 [T, chunks·H], float32 scale [T, chunks])."""
    tokens, width = x.shape
    scale = x.float().reshape(tokens, chunks, width // chunks).abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    return quantize_with(x, scale), scale


def quantize_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [T, chunks·H] → e4m3 [T, chunks·H] at the given float32 ``scale`` [T, chunks] (the store's rounding)."""
    tokens, width = x.shape
    grouped = x.float().reshape(tokens, scale.shape[-1], -1)
    q = (grouped / scale.float().unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(tokens, width)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to e4m3 rounding), in ``dtype``."""
    tokens, width = q.shape
    chunks = scale.shape[-1]
    grouped = q.float().reshape(tokens, chunks, width // chunks) * scale.float().unsqueeze(-1)
    return grouped.reshape(tokens, width).to(dtype)
