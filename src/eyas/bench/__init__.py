"""``eyas bench`` and ``eyas generate``: load a target and a drafter directory, decode, measure."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.engine.draft_runner import DraftRunner
from eyas.engine.target_runner import TargetRunner


@dataclass
class Engine:
    """A loaded target and drafter behind their runners, plus what decoding needs to know."""

    target: object  # eyas.target.loading.Target
    target_runner: TargetRunner
    draft_runner: DraftRunner
    stop_ids: set[int] = field(default_factory=set)


DRAFTER_SPARE = 16  # max depth + 1 of any mode up to depth 15: see load_engine


def load_engine(target_spec: str, draft_dir: Path, capacity: int, device: str | None = None,
                trust_remote_code: bool = False, dtype: torch.dtype | None = None, target=None,
                graphs: bool = True, compile: bool = False, lean: bool = True) -> Engine:
    """Target (eyas' default dtype for the device unless given) and drafter (same device and dtype),
    with stop ids; ``target`` reuses an already loaded target. ``graphs``: on CUDA, decoding steps
    replay CUDA graphs; ``compile``: the target's steps are fused by torch.compile before recording;
    ``lean``: with graphs, Llama-family targets decode through :mod:`eyas.engine.lean` (fused projections;
    1.26× the HF forward's plain decoding, compiled, on the H200: BENCHMARKS.md). The drafter's cache
    holds ``DRAFTER_SPARE`` slots more than the target's: a burst round commits max depth + 1 states
    whatever was accepted, so without them the last rounds of a generation would leave the bursts."""
    from eyas.export.load import load_drafter
    from eyas.target.loading import load_target

    target = target or load_target(target_spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    layout = target.layout
    drafter = load_drafter(draft_dir, layout.embed.weight, layout.num_layers, device=layout.embed.weight.device,
                           dtype=layout.embed.weight.dtype)
    runner = TargetRunner(target.model, layout, drafter.config.layer_ids, capacity, graphs=graphs, compile=compile,
                          lean=lean)
    return Engine(target, runner, DraftRunner(drafter, capacity + DRAFTER_SPARE, graphs=graphs), stop_ids(target))


def stop_ids(target) -> set[int]:
    """End-of-sequence ids of the generation config and the tokenizer (chat models end turns with them)."""
    ids: set[int] = set()
    eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if target.tokenizer is not None and target.tokenizer.eos_token_id is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    return ids


def prompt_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long)
