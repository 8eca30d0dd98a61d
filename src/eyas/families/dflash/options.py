"""DFlash's own options of ``eyas train`` (the registry adds them to its flags, each help led by "dflash: ")."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.options import Options, above, at_least, option


@dataclass
class DFlashOptions(Options):
    """How a DFlash block drafter is built and trained."""

    block_size: int = option(16, "tokens a block holds, its anchor included (it proposes block-size − 1); the "
                             "published drafters' 16", check=at_least(2))
    draft_layers: int = option(5, "decoder layers (the published drafters' 5)", check=at_least(1))
    block_coverage: float = option(1.0, "block rows per token of a batch row (blocks per row = coverage × "
                                   "width / block size, anchored at random trained places; above 1 it runs as "
                                   "passes of width / block size blocks, each its own forward and backward)",
                                   check=above(0))
    slot_decay: float | None = option(7.0, "slot k's loss weight is exp(−(k − 1)/γ), γ this (the published 7 "
                                      "for blocks of 16)", check=above(0))
    mask_token_id: int | None = option(None, "the token id of a block's mask slots (default: the vocabulary's "
                                       "last id)", check=at_least(0))
