"""A target and a drafter directory loaded behind the engine's runners: what ``eyas bench`` and ``eyas generate`` decode with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.engine.block_runner import BlockDraftRunner
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.modes import Speculation, check_block_modes, check_modes_fit, drafter_spare
from eyas.engine.target_runner import TargetRunner


@dataclass
class Engine:
    """A loaded target and (maybe) drafter behind their runners, plus the ids that end a turn."""

    target: object  # eyas.target.loading.Target
    target_runner: TargetRunner
    draft_runner: DraftRunner | BlockDraftRunner | None
    stop_ids: set[int] = field(default_factory=set)


def load_engine(target_spec: str, draft_dir: Path | None, capacity: int, device: str | None = None,
                trust_remote_code: bool = False, dtype: torch.dtype | None = None, target=None,
                graphs: bool = True, compile: bool = False, lean: bool = True,
                modes: Sequence[Speculation] = ()) -> Engine:
    """Target (eyas' default dtype for the device unless given) and, with ``draft_dir``, its drafter (same device
    and dtype); ``target`` reuses an already loaded target. ``graphs``: on CUDA, decoding steps replay CUDA
    graphs; ``compile``: the target's steps are fused by torch.compile before recording; ``lean``: Llama-family
    targets decode through :mod:`eyas.engine.fused_llama`. The drafter's cache holds :func:`drafter_spare` slots more
    than the target's for the ``modes`` it will decode (a tree wider than the drafter's vocabulary is refused); a DFlash
    directory decodes chains of up to its block − 1 drafts (:mod:`eyas.engine.block_runner`)."""
    from eyas.export.dflash import dflash_block, load_dflash_dir
    from eyas.export.load import load_drafter
    from eyas.target.loading import load_target, stop_ids

    target = target or load_target(target_spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    layout = target.layout
    weight = layout.embed.weight
    drafter = draft_runner = None
    if dflash_block(draft_dir):  # a block drafter: the target's embedding and lm_head
        drafter = load_dflash_dir(draft_dir, weight.dtype).to(weight.device)
        check_block_modes(modes, drafter.config.block_size, str(draft_dir))
        draft_runner = BlockDraftRunner(drafter, weight, layout.lm_head,
                                        capacity + max(drafter.config.block_size, drafter_spare(modes)))
    elif draft_dir is not None:
        drafter = load_drafter(draft_dir, weight, layout.num_layers, device=weight.device, dtype=weight.dtype)
        check_modes_fit(modes, drafter.config.draft_vocab_size, str(draft_dir))
        draft_runner = DraftRunner(drafter, capacity + drafter_spare(modes))
    runner = TargetRunner(target.model, layout, drafter.config.layer_ids if drafter else None, capacity, graphs=graphs,
                          compile=compile, lean=lean)
    return Engine(target, runner, draft_runner, set(stop_ids(target.model, target.tokenizer)))


def load_target_for(draft_dir: Path | None, target_spec: str, device: str | None = None, trust_remote_code: bool = False):
    """The target to decode with ``draft_dir``, loaded only once the drafter is known to fit it (:mod:`eyas.export.fit`:
    a drafter made for another target fails in one line, before any weight is read)."""
    from eyas.export.fit import require_fit
    from eyas.target.loading import load_target

    require_fit(draft_dir, target_spec, trust_remote_code)
    return load_target(target_spec, device=device, trust_remote_code=trust_remote_code)


def prompt_tensor(ids: list[int]) -> torch.Tensor:
    """Token ids as the [1, P] tensor the engine takes."""
    return torch.tensor([ids], dtype=torch.long)
