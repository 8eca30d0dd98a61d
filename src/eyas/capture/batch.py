"""One forward batch of samples captured by the target loaded with HF, in storage form: what a store's shard holds
(:mod:`eyas.capture.stage`) and what a stream carries to the trainer (:mod:`eyas.train.stream`) — one rule, so that a streamed
run reads the values an offline run reads from a store."""

from __future__ import annotations

from collections.abc import Sequence

from eyas.data.samples import Sample, batch_inputs
from eyas.store.shards import Pack, pack_states


def capture_batch(target, rows: Sequence[Sample], layer_ids: Sequence[int], dtype: str, compile_layers: bool) -> Pack:
    """``rows`` in one right-padded forward of ``target`` (an :class:`eyas.target.Target`) as wide as the longest row
    (on CUDA with ``compile_layers``, its decoder layers compiled); the padding dropped, the states cast (or quantised
    to fp8) where they were computed: a :class:`Pack` of ``dtype`` (bf16, fp16, fp32, fp8)."""
    from eyas.target import capture_hidden_states

    ids, mask = batch_inputs(list(rows))
    captured = capture_hidden_states(target.model, target.layout, ids, attention_mask=mask, layer_ids=layer_ids,
                                     offload=False, compile_layers=compile_layers)
    real = mask.to(captured.aux.device).bool()  # right padding: row-major order keeps samples in sequence
    return pack_states([r.input_ids for r in rows], [r.loss_mask for r in rows], captured.aux[real], captured.final[real],
                       dtype, len(layer_ids))


def pack_rows(rows: Sequence[Sample], states: Sequence[tuple], dtype: str, layers: int) -> Pack:
    """``rows`` with their per-sample states (aux [T, k·H], final [T, H] each, as vLLM's capture gives them; k =
    ``layers``) as one :class:`Pack` of ``dtype``, as :func:`capture_batch` packs a batch."""
    import torch

    return pack_states([r.input_ids for r in rows], [r.loss_mask for r in rows], torch.cat([a for a, _ in states]),
                       torch.cat([f for _, f in states]), dtype, layers)
