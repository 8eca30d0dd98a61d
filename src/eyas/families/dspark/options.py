"""DSpark's own options of ``eyas train`` (the registry adds them to its flags, each help led by the families that read
it). ``--draft-layers``, ``--block-coverage`` and ``--mask-token-id`` are shared with DFlash (the same backbone); the
block and its loss decay are DSpark's own flags because their published values differ from DFlash's."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.options import Options, above, at_least, option, within


@dataclass
class DSparkOptions(Options):
    """How a DSpark drafter (a block backbone and a Markov head) is built and trained."""

    spark_block: int = option(7, "tokens a block proposes in one forward: its anchor and spark-block − 1 mask slots, "
                              "each predicting the token after it (the DSpark paper's 7)", check=at_least(1))
    draft_layers: int = option(5, "decoder layers (the published drafters' 5)", check=at_least(1))
    block_coverage: float = option(1.0, "block rows per token of a batch row (blocks per row = coverage × "
                                   "width / block size, anchored at random trained places; above 1 it runs as "
                                   "passes of width / block size blocks, each its own forward and backward)",
                                   check=above(0))
    mask_token_id: int | None = option(None, "the token id of a block's mask slots (default: the vocabulary's "
                                       "last id)", check=at_least(0))
    markov_rank: int = option(256, "width of the Markov head: each proposal's logits get a bias W2·W1(previous "
                              "token), W1 and W2 vocabulary × this (the paper's 256)", check=at_least(1))
    spark_decay: float | None = option(4.0, "slot j's loss weight is exp(−j/γ), γ this (the paper's 4 for blocks "
                                       "of 7)", check=above(0))
    spark_l1: float = option(0.9, "share of the loss that is the L1 distance between the drafter's and the target's "
                             "distributions (1 − the acceptance rate of a drawn draft, twice over); the rest is "
                             "cross-entropy against the target's greedy token (the paper's 0.9 / 0.1)",
                             check=within(0, 1))
    confidence_head: bool = option(False, "also train DSpark's confidence head: a linear probe of each slot's state and "
                                   "the previous token's Markov embedding that predicts the chance vLLM accepts the "
                                   "slot's draft (vLLM's adaptive verification sets the verify length from it under "
                                   "load; eyas' engine does not read it); its loss, binary cross-entropy against that "
                                   "chance at T = 1, is added to the slot's")
