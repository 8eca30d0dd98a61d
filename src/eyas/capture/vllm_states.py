"""The capture stage's state source for ``--engine vllm``: packs built from vLLM's per-sample states."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eyas.capture.batch import pack_rows
from eyas.capture.vllm_client import capture_with_vllm, engine_request
from eyas.errors import EyasError
from eyas.store.plan import ShardPlan

WORKDIR = ".vllm"  # inside FEATURES_DIR: vLLM's per-sample files, kept until the store is complete (resume)


def vllm_states(options, source: str, layer_ids: tuple[int, ...], num_layers: int, todo, samples):
    """A function (split, plan) → one Pack per planned batch, fed by one vLLM run over every pending sample."""
    ordered = [samples[split][i] for split, plan in todo for i in plan.samples]
    stream: Iterator = capture_with_vllm(
        ((s.id, s.input_ids) for s in ordered), source, tuple(layer_ids), num_layers, options.vllm_python,
        options.out / WORKDIR, engine_request(options),
    )

    def states(split: str, plan: ShardPlan):
        for batch in plan.batches:
            rows = [samples[split][i] for i in batch]
            yield pack_rows(rows, [_next_of(stream, row.id) for row in rows], options.dtype, len(layer_ids))

    return states


def _next_of(stream: Iterator, expected: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The next sample's (aux, final) from vLLM's capture, which must be sample ``expected``."""
    sample_id, aux, final = next(stream)
    if sample_id != expected:
        raise EyasError(f"vLLM returned sample {sample_id!r} where {expected!r} was expected")
    return aux, final
