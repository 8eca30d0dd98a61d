"""Activation memory of a training micro-batch, measured without a GPU: the TTT unroll and its loss on meta tensors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from eyas.families.eagle3.config import DrafterConfig


class _FusedAttention(torch.autograd.Function):
    """What the GPU's fused attention saves for backward (q, k, v, out, logsumexp, the mask), shapes only: on the meta
    device PyTorch would decompose attention into the math path and keep [B, h, T, S] scores the GPU never writes."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32), mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


@contextmanager
def saved_storages(module: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Within the block: every storage autograd saves for backward, once, by its bytes (``module``'s parameters not
    counted: they exist whether or not a graph is kept). Keep the saved tensors alive until the count is read, so no
    storage is freed and its address reused."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def ttt_saved_bytes(config: DrafterConfig, rows: int, length: int, steps: int) -> int:
    """Bytes autograd keeps for backward over a TTT unroll and its loss at these widths (meta tensors, bf16 as autocast
    computes): the activation memory of a training micro-batch."""
    from eyas.families.eagle3.loss import TargetSignal, step_loss
    from eyas.families.eagle3.model import Eagle3Drafter
    from eyas.families.eagle3.ttt import ttt_steps

    with torch.device("meta"):
        drafter = Eagle3Drafter(config).to(torch.bfloat16)
        aux = torch.empty(rows, length, config.aux_width, dtype=torch.bfloat16)
        ids = torch.zeros(rows, length, dtype=torch.long)
        signal = TargetSignal(torch.empty(rows, length, config.draft_vocab_size), torch.zeros(rows, length, dtype=torch.long),
                              torch.ones(rows, length, dtype=torch.bool))
        mask = torch.ones(rows, length, dtype=torch.uint8)
    def sdpa(q, k, v, attn_mask=None, is_causal=False, **_):
        return _FusedAttention.apply(q, k, v, attn_mask if attn_mask is not None else torch.empty(0, device=q.device))

    with saved_storages(drafter) as saved, mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa):
        kept = [step_loss(logits, signal, mask, k, compile=False).loss  # the trainer keeps every step's graph
                for k, logits in enumerate(ttt_steps(drafter, aux, ids, steps, attention="concat"))]
    assert len(kept) == steps  # alive until here: no storage is freed and its address reused while counting
    return sum(saved.values())
