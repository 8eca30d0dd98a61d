"""Training the DSpark drafter (``eyas train --drafter dspark``) from the batches every family trains on.

The same sources (:mod:`eyas.train.data`: a feature store, or the target online) give each batch's tapped states
``aux`` — the backbone's context — and its final states, the target's distribution at every position
(:func:`eyas.families.dspark.model.spark_loss` reads it at each slot). Each batch row gets ``coverage × width / block``
blocks anchored at random usable places (:func:`eyas.families.dspark.model.draw_anchors`), drawn from a generator
seeded by the batch's place in the run (:func:`eyas.train.data.batch_seed`), so a resumed run draws what an
uninterrupted one would. Above a coverage of one the blocks run as passes of at most ``width / block`` blocks per row,
each its own forward and backward, whose losses share one denominator: they add up to one forward over every block.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eyas.families.dflash.objective import anchor_generator, block_passes, blocks_per_row
from eyas.families.dspark.model import DSparkDrafter, SparkStats, draw_anchors, slot_weight_total, slot_weights, spark_loss


def score_blocks(drafter: DSparkDrafter, batch, head: torch.Tensor, embed: torch.Tensor, options,
                 generator: torch.Generator) -> Iterator[SparkStats]:
    """One batch's blocks, drawn, then scored one pass at a time (the passes' losses, shares and counts add up to the
    whole batch's)."""
    block = drafter.config.block_size
    width = batch.input_ids.shape[1]
    trained = batch.loss_mask > 0
    anchors, usable = draw_anchors(batch.loss_mask, batch.valid, block,
                                   blocks_per_row(width, block, options.block_coverage), generator)
    weights = slot_weights(block, options.spark_decay, batch.input_ids.device)
    normalizer = slot_weight_total(trained, anchors, usable, weights)
    for part, part_usable in block_passes(anchors, usable, blocks_per_row(width, block, 1.0)):
        yield spark_loss(drafter, batch.aux, batch.input_ids, batch.final, trained, part, part_usable, embed, head,
                         weights, options.spark_l1, normalizer)


def spark_micro_batch(drafter: DSparkDrafter, batch, head: torch.Tensor, embed: torch.Tensor, options, autocast,
                      tallies: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seed: int) -> int:
    """Forward and backward of one micro-batch, pass by pass; adds each slot's share of the loss, hits and counted
    slots to ``tallies`` [B] (on the device, not read back); returns the batch's real tokens."""
    shares, correct, counted = tallies
    passes = score_blocks(drafter, batch, head, embed, options, anchor_generator(batch.input_ids.device, seed))
    while True:
        with autocast():
            stats = next(passes, None)
        if stats is None:
            return batch.tokens
        (stats.loss / options.grad_accum).backward()
        shares += stats.shares / options.grad_accum
        correct += stats.correct
        counted += stats.counted


@torch.no_grad()
def evaluate_spark(drafter: DSparkDrafter, source, head: torch.Tensor, embed: torch.Tensor, options,
                   max_batches: int | None = None, autocast=None) -> dict:
    """Loss, per-slot accuracy, acceptance and simulated τ on the holdout batches, the same blocks every evaluation
    (each batch's anchors seeded by its index), over blocks whose every slot is counted: ``tau`` = 1 + the mean run of
    right greedy drafts from slot 0 (a greedy chain of B drafts verified at each block's anchor); ``tau_drawn`` = 1 +
    the expected drafts accepted of a chain drawn at temperature 1 (Σ_k Π_{j ≤ k} (1 − ½·L1_j), the Markov head fed
    the sequence's tokens)."""
    was_training = drafter.training
    drafter.eval()
    slots = drafter.config.block_size
    loss, batches = 0.0, 0
    correct, counted, depth = torch.zeros(slots), torch.zeros(slots), torch.zeros(slots)
    accepted, drawn, blocks = 0.0, 0.0, 0.0
    for b in range(len(source.batches) if max_batches is None else min(max_batches, len(source.batches))):
        batch = source.batch(b)
        with autocast():
            for stats in score_blocks(drafter, batch, head, embed, options, anchor_generator(batch.input_ids.device, b)):
                loss += float(stats.loss)
                correct += stats.correct.cpu()
                counted += stats.counted.cpu()
                depth += stats.depth_counts.cpu()
                accepted += float(stats.accepted)
                drawn += float(stats.drawn_accepted)
                blocks += float(stats.blocks)
        batches += 1
    drafter.train(was_training)
    cumulative = (depth / max(blocks, 1.0)).tolist()
    conditional = [cumulative[0]] + [cumulative[k] / cumulative[k - 1] if cumulative[k - 1] else 0.0
                                     for k in range(1, slots)]
    return {"loss": loss / max(batches, 1), "accuracy": (correct / counted.clamp(min=1)).tolist(),
            "acceptance_cumulative": cumulative, "acceptance_conditional": conditional,
            "tau": 1.0 + accepted / max(blocks, 1.0), "tau_drawn": 1.0 + drawn / max(blocks, 1.0), "blocks": blocks,
            "positions": blocks}
