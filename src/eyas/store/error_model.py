"""The capture check's error model: does a stored state differ from the live forward by more than rounding?

Per token t, with s_t the stored state, l_t the live (re-captured) one and Q the store's own
rounding (a cast to bf16/fp16/fp32, or e4m3 at the store's per-token scale):

- ``rounded`` = ||s_t − Q(l_t)|| / ||l_t|| and the cosine of s_t and l_t, as information;
- ``rel`` = ||d_t|| / ||l_t||, the decision, where d_i is how far l_i lies outside the rounding cell
  of s_i (the interval of values the store rounds to s_i). A correct capture c rounded into s has
  c_i in that cell, so ||d_t|| ≤ ||c_t − l_t||: ``rel`` measures the compute difference alone, with
  the store's unit roundoff taken out element by element (a 1-ulp flip at a rounding boundary
  costs only the distance to that boundary), and is bounded by the noise between two forwards.

The bound is that noise, by the noisier compute dtype of the capture and of the re-capture
(COMPUTE_NOISE). Measured on the tests' tiny zoo targets (CPU, 2026-12-02; tests/test_capture_check_model.py):
fp32 batched capture vs alone ≤ 2e-6 per token; vLLM fp32 vs HF fp32 ≤ 2e-7 (issue 28); bf16
compute vs fp32 ≤ 2 % on dense targets and up to 13 % on MoE ones (a routing flip moves a token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eyas.store import fp8
from eyas.store.shards import DTYPES

# Largest per-token relative L2 difference two correct forwards may show, by the noisier one's compute dtype:
# fp32 ≥ 50× what was measured (2e-6), so a 0.1 % error still fails; bf16/fp16 cover the MoE routing flips measured.
COMPUTE_NOISE = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 2.5e-1}
UNKNOWN_COMPUTE = "bfloat16"  # a store made before eyas recorded its compute dtype: judged by the loosest bound


@dataclass
class TensorFit:
    """One tensor's (a layer id's, or the final hidden's) comparison over the re-captured tokens."""

    tokens: int = 0
    worst_rel: float = 0.0  # max over tokens of the relative error beyond the store's rounding (the decision)
    worst_rounded: float = 0.0  # max over tokens of ||stored − Q(live)|| / ||live||
    min_cos: float = 1.0
    worst_at: str = "-"  # "sample id, token t" of worst_rel ("-" while every token is exact)

    def add(self, sample_id: str, stored: torch.Tensor, live: torch.Tensor, dtype: str, scale: torch.Tensor | None) -> None:
        """Fold in one sample's tokens: ``stored``, ``live`` [T, H] float32; ``scale`` [T, 1] for fp8 stores."""
        rel, rounded, cos = token_errors(stored, live, dtype, scale)
        worst = int(rel.argmax())
        if rel[worst].item() > self.worst_rel:
            self.worst_rel, self.worst_at = rel[worst].item(), f"{sample_id}, token {worst}"
        self.worst_rounded = max(self.worst_rounded, rounded.max().item())
        self.min_cos = min(self.min_cos, cos.min().item())
        self.tokens += len(rel)


def rounded_like_store(live: torch.Tensor, dtype: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Q(live): ``live`` [T, H] rounded as a ``dtype`` store rounds it (fp8: at the store's ``scale`` [T, 1]), in float32."""
    if dtype == "fp8":
        return fp8.dequantize(fp8.quantize_with(live, scale), scale, torch.float32)
    return live.to(DTYPES[dtype]).float()


def beyond_rounding(stored: torch.Tensor, live: torch.Tensor, dtype: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """|d|: how far each live value lies outside the rounding cell of its stored value (0 inside), [T, H] float32."""
    unit = scale.float() if dtype == "fp8" else torch.ones(())
    grid = (stored / unit).to(DTYPES[dtype]).float()  # the stored values on the format's own grid (fp8: e4m3 codes)
    toward = live / unit
    return ((toward - grid).abs() - _half_gap(grid, toward, DTYPES[dtype])).clamp(min=0) * unit


def token_errors(stored: torch.Tensor, live: torch.Tensor, dtype: str, scale: torch.Tensor | None = None):
    """Per token: (relative error beyond rounding, ||stored − Q(live)|| / ||live||, cosine), each [T]."""
    stored, live = stored.float(), live.float()
    norm = live.norm(dim=-1).clamp(min=1e-12)
    rel = beyond_rounding(stored, live, dtype, scale).norm(dim=-1) / norm
    rounded = (stored - rounded_like_store(live, dtype, scale)).norm(dim=-1) / norm
    return rel, rounded, torch.nn.functional.cosine_similarity(stored, live, dim=-1, eps=1e-12)


def noise_bound(*compute_dtypes: str | None) -> tuple[float, str]:
    """The bound on ``rel`` for forwards run in these dtypes (torch names: float32, bfloat16, …), and the dtype it is for."""
    known = [d if d in COMPUTE_NOISE else UNKNOWN_COMPUTE for d in compute_dtypes]
    noisiest = max(known, key=COMPUTE_NOISE.__getitem__)
    return COMPUTE_NOISE[noisiest], noisiest


def _half_gap(grid: torch.Tensor, toward: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the distance from each ``grid`` value to its neighbour on ``dtype``'s grid in the direction of ``toward``."""
    info = torch.finfo(dtype)
    smallest = math.log2(info.tiny)  # subnormals share the spacing of the smallest normal binade
    mantissa, exponent = torch.frexp(grid)  # |grid| = |m|·2^e with |m| in [0.5, 1): binade [2^(e-1), 2^e)
    binade = torch.where(grid == 0, smallest, (exponent - 1).float().clamp(min=smallest))
    gap = info.eps * torch.exp2(binade)
    outward = (toward.abs() > grid.abs()) & (toward * grid >= 0)
    inward_at_power = ~outward & (mantissa.abs() == 0.5) & (binade > smallest)  # the binade below has half the spacing
    return torch.where(inward_at_power, gap / 2, gap) / 2
