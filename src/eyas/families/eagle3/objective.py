"""EAGLE-3's training step: the target's teacher distribution from its final hidden state, K training-time-test steps,
Σ_k decay^k · loss_k (the forward the engine drafts with, :mod:`eyas.families.eagle3.ttt`; the loss
:mod:`eyas.families.eagle3.loss`)."""

from __future__ import annotations

import torch

from eyas.families.eagle3.loss import harmonized, step_loss, target_signal
from eyas.families.eagle3.model import Eagle3Drafter
from eyas.families.eagle3.ttt import ttt_steps


def micro_batch(drafter: Eagle3Drafter, batch, head: torch.Tensor, draft_ids: torch.Tensor, options,
                weights: list[float], autocast, tallies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
    """Forward (the teacher, K TTT steps) and backward of one micro-batch; adds each step's loss, hits and counted
    positions to ``tallies`` (on the device, not read back); returns the batch's real tokens."""
    losses, correct, counted = tallies
    signal = target_signal(batch.final, head, draft_ids, mass=options.objective.startswith("lk"))  # the LK losses' α
    if options.objective == "hass":
        signal = harmonized(signal, options.hass_top_k, options.hass_weight)
    total = 0.0
    with autocast():
        attention = None if options.attention == "auto" else options.attention
        for k, logits in enumerate(ttt_steps(drafter, batch.aux, batch.input_ids, options.ttt_steps, attention)):
            result = step_loss(logits, signal, batch.loss_mask, k, objective=options.objective, lk_decay=options.lk_decay)
            total = total + weights[k] * result.loss
            losses[k] += result.loss.detach() / options.grad_accum
            correct[k] += result.correct
            counted[k] += result.count
    (total / options.grad_accum).backward()
    return batch.tokens


def new_drafter(config, d2t, head: torch.Tensor, embed: torch.Tensor, draft_ids: torch.Tensor, seed: int) -> Eagle3Drafter:
    """A drafter of ``config`` seeded ``seed``, reading the target's embedding; as wide as the target, its lm_head starts
    from the target's rows of the draft vocabulary (they read the same space)."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config, d2t=d2t)
    drafter.load_target_embedding(embed)
    if config.hidden_size == config.target_hidden_size:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head[draft_ids.cpu()].float())
    return drafter


def shard(drafter: Eagle3Drafter) -> None:
    """FSDP2 over ranks, one unit per module the TTT forward calls (it calls them directly, not the root)."""
    from torch.distributed.fsdp import fully_shard

    norms = list(drafter.fc_norm) if drafter.config.fc_norm else []  # each a unit: fuse() calls them one by one
    for module in (drafter.embed_tokens, drafter.fc, drafter.midlayer, drafter.norm, drafter.lm_head, *norms):
        fully_shard(module)
