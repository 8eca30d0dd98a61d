"""Holdout evaluation: per-position acceptance (conditional and cumulative) and simulated τ.

At every assistant position the drafter drafts K tokens (training-time test, teacher-forced tokens);
draft k is accepted when it equals the target's greedy choice and all drafts before it were
accepted. Cumulative acceptance a_k is the share of positions whose first k+1 drafts are all
accepted; conditional acceptance is a_k / a_{k−1}; simulated τ = 1 + Σ_k a_k (tokens per target
forward of a greedy chain of K drafts).
"""

from __future__ import annotations

import torch

from eyas.drafter.loss import step_loss, target_signal
from eyas.drafter.ttt import shift_left, ttt_steps


@torch.no_grad()
def evaluate(drafter, source, head: torch.Tensor, draft_ids: torch.Tensor, steps: int, step_weights: list[float],
             max_batches: int | None = None, autocast=None) -> dict:
    """Loss, accuracies, acceptance and τ of ``drafter`` on every batch of ``source`` (holdout)."""
    was_training = drafter.training
    drafter.eval()
    positions = 0.0
    accepted = torch.zeros(steps, dtype=torch.float64)
    loss_sum, loss_count = 0.0, 0
    correct, counted = torch.zeros(steps), torch.zeros(steps)
    for b in range(len(source.batches) if max_batches is None else min(max_batches, len(source.batches))):
        batch = source.batch(b)
        signal = target_signal(batch.final, head, draft_ids)
        base = shift_left(batch.loss_mask, 2) > 0  # step 0 predicts an assistant token
        alive = base.clone()
        total = 0.0
        with autocast():
            for k, logits in enumerate(ttt_steps(drafter, batch.aux, batch.input_ids, steps)):
                result = step_loss(logits, signal, batch.loss_mask, k)
                total += step_weights[k] * float(result.loss)
                correct[k] += float(result.correct)
                counted[k] += float(result.count)
                alive &= result.hits  # draft k right where it is counted: an assistant token the draft vocabulary holds
                accepted[k] += float(alive.sum())
        positions += float(base.sum())
        loss_sum += total
        loss_count += 1
    drafter.train(was_training)
    cumulative = (accepted / max(positions, 1.0)).tolist()
    conditional = [cumulative[0]] + [cumulative[k] / cumulative[k - 1] if cumulative[k - 1] else 0.0 for k in range(1, steps)]
    return {
        "loss": loss_sum / max(loss_count, 1),
        "accuracy": (correct / counted.clamp(min=1)).tolist(),
        "acceptance_cumulative": cumulative,
        "acceptance_conditional": conditional,
        "tau": 1.0 + sum(cumulative),
        "positions": positions,
    }
