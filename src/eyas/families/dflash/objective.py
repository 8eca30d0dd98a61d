"""Training the DFlash block drafter (``eyas train --drafter dflash``) from the batches every family trains on.

The same sources (:mod:`eyas.train.data`: a feature store, or the target online) give each batch's tapped states
``aux`` — the drafter's context — and its final states, from which the target's own greedy token at every position is
read (:func:`eyas.families.dflash.model.teacher_tokens`): the labels, so that a slot is right exactly when a greedy
verification would accept it, whatever the data's answers were. Each batch row gets ``coverage × width / block``
blocks anchored at random trained places (:func:`eyas.families.dflash.model.block_anchors`), drawn from a generator
seeded by the batch's place in the run (:func:`eyas.train.data.batch_seed`), so a resumed run draws what an
uninterrupted one would. The loss, the mask and the drafting they equal are :mod:`eyas.families.dflash.model`'s;
tests/test_dflash.py pins them.

A coverage above one runs as passes of at most ``width / block`` blocks per row, each its own forward (and, in
training, its own backward): one forward over all n blocks would attend over n·B own-block keys per query, nearly all
masked (at coverage 16, 94 % of the keys), and hold every slot's logits at once. The passes' losses share one
denominator, so they add up to the loss of all the blocks in one forward, and their gradients to its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from eyas.families.dflash.model import (
    BlockStats,
    DFlashDrafter,
    block_anchors,
    block_loss,
    slot_weight_total,
    slot_weights,
    teacher_tokens,
)


def blocks_per_row(width: int, block_size: int, coverage: float) -> int:
    """How many blocks each row of a batch ``width`` wide is given."""
    return max(1, math.ceil(coverage * width / block_size))


def anchor_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def block_passes(anchors: torch.Tensor, usable: torch.Tensor, per_pass: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch's anchors and usable [R, n] in consecutive groups of at most ``per_pass`` blocks per row (the draw's
    order is random, so each group is a random share of the blocks)."""
    return list(zip(anchors.split(per_pass, dim=1), usable.split(per_pass, dim=1), strict=True))


def score_blocks(drafter: DFlashDrafter, batch, head: torch.Tensor, embed: torch.Tensor, options, generator
                 ) -> Iterator[BlockStats]:
    """One batch's blocks, drawn, then scored one pass at a time (:class:`eyas.families.dflash.model.BlockStats` per pass;
    the passes' losses, shares and counts add up to the whole batch's)."""
    config = drafter.config
    width = batch.input_ids.shape[1]
    labels = teacher_tokens(batch.final, head)
    trained = batch.loss_mask > 0
    count = blocks_per_row(width, config.block_size, options.block_coverage)
    anchors, usable = block_anchors(batch.loss_mask, batch.valid, config.block_size, count, generator)
    weights = slot_weights(config.block_size, options.slot_decay, batch.input_ids.device)
    normalizer = slot_weight_total(trained, anchors, usable, weights)
    for part, part_usable in block_passes(anchors, usable, blocks_per_row(width, config.block_size, 1.0)):
        yield block_loss(drafter, batch.aux, batch.input_ids, labels, trained, part, part_usable, embed, head, weights,
                         normalizer)


def block_micro_batch(drafter: DFlashDrafter, batch, head: torch.Tensor, embed: torch.Tensor, options, autocast,
                      tallies: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seed: int) -> int:
    """Forward and backward of one micro-batch, pass by pass; adds each slot's share of the loss, hits and trained
    slots to ``tallies`` [B − 1] (on the device, not read back); returns the batch's real tokens."""
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
def evaluate_blocks(drafter: DFlashDrafter, source, head: torch.Tensor, embed: torch.Tensor, options,
                    max_batches: int | None = None, autocast=None) -> dict:
    """Loss, per-slot accuracy, acceptance and simulated τ on the holdout batches, the same blocks every evaluation
    (each batch's anchors seeded by its index). τ = 1 + the mean run of right drafts from slot 1 over blocks whose
    every slot is trained: a greedy chain of B − 1 drafts verified at each block's anchor."""
    was_training = drafter.training
    drafter.eval()
    slots = drafter.config.block_size - 1
    loss, batches = 0.0, 0
    correct, counted, depth = torch.zeros(slots), torch.zeros(slots), torch.zeros(slots)
    accepted, blocks = 0.0, 0.0
    for b in range(len(source.batches) if max_batches is None else min(max_batches, len(source.batches))):
        batch = source.batch(b)
        with autocast():
            for stats in score_blocks(drafter, batch, head, embed, options, anchor_generator(batch.input_ids.device, b)):
                loss += float(stats.loss)
                correct += stats.correct.cpu()
                counted += stats.counted.cpu()
                depth += stats.depth_counts.cpu()
                accepted += float(stats.accepted)
                blocks += float(stats.blocks)
        batches += 1
    drafter.train(was_training)
    cumulative = (depth / max(blocks, 1.0)).tolist()
    conditional = [cumulative[0]] + [cumulative[k] / cumulative[k - 1] if cumulative[k - 1] else 0.0
                                     for k in range(1, slots)]
    return {"loss": loss / max(batches, 1), "accuracy": (correct / counted.clamp(min=1)).tolist(),
            "acceptance_cumulative": cumulative, "acceptance_conditional": conditional,
            "tau": 1.0 + accepted / max(blocks, 1.0), "blocks": blocks,
            "positions": blocks}  # what the evaluation judged, under the name every family's evaluation gives it
