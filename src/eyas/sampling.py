"""Sampling's two rules, one place for everything that samples or simulates sampling: the distribution a temperature
and top-p sample from (:func:`sampling_probs`), and a token drawn from it at a uniform (:func:`draw`).

The engine samples the target and draws drafts (:mod:`eyas.engine.acceptance`), regeneration samples the target's
answers (:mod:`eyas.data.batched_decode`), training's evaluation simulates drawn chains (:mod:`eyas.families.eagle3.evaluate`,
:func:`eyas.families.eagle3.loss.target_signal`). The distribution is transformers': softmax(logits / T), then, with top-p < 1,
only the smallest set of likeliest tokens whose mass reaches top-p, renormalised (the likeliest token always stays).
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution of each row of ``logits`` [..., V] at ``temperature`` (> 0; a tensor broadcasts, e.g.
    a row's own [B, 1]) and ``top_p``, float32."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p (the most likely token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@torch.compiler.disable
def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token from each row of ``probs`` [..., V] (need not sum to 1) at ``uniforms`` [...] in [0, 1): the row's
    cumulative sum inverted there, in float64 — a token of zero mass is never drawn. On the device, no host read.

    Kept out of torch.compile (a compiled decoding round runs it eagerly, still inside the round's CUDA graph): inductor
    (torch 2.11, Triton) fails to generate its float64 scan over a full vocabulary for several rows at once — a
    block drafter's drawn chain, 15 x 49,152 — and the whole round then fell back to eager decoding."""
    cumulative = probs.double().cumsum(-1)
    point = uniforms.double().unsqueeze(-1) * cumulative[..., -1:]
    return torch.searchsorted(cumulative, point, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
