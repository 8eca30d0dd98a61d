"""Holdout evaluation: per-position acceptance (conditional and cumulative) and simulated τ.

At every assistant position the drafter drafts K tokens (training-time test, teacher-forced tokens);
draft k is accepted when it equals the target's greedy choice and all drafts before it were
accepted. Cumulative acceptance a_k is the share of positions whose first k+1 drafts are all
accepted; conditional acceptance is a_k / a_{k−1}; simulated τ = 1 + Σ_k a_k (tokens per target
forward of a greedy chain of K drafts) = 1 + the mean accepted depth.

That τ averages over every assistant token of whole conversations, and where an answer is long and
repetitive its tail is easy to draft: a drafter simulates a much higher τ late in long answers than
over their first tokens (``benchmarks/acceptance_by_place.py`` shows it by place). ``tau_answer_start`` is the same simulation
restricted to the first ``ANSWER_START`` tokens of each conversation's first answer — the stretch a
short ``eyas bench`` decodes.

Sampling at temperature T, a chain whose drafts are drawn from the drafter (the engine's ``--draft-sampling
probabilistic``) keeps draft k with probability α_k = Σ_x min(p_T(x), q_T(x)) once the drafts before it were kept,
where p_T is the target's sampling distribution and q_T the drafter's, both softmax(logits / T), over the draft
vocabulary (the target's mass outside it cannot be drafted). ``tau_at_temperature`` is 1 + the mean of
Σ_k Π_{j ≤ k} α_j over the same positions: the expected τ of such chains, with the teacher-forced answer (a greedy
one, in T = 0 data) as their context — an estimate, since a sampled answer soon leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eyas.families.eagle3.loss import StepResult, step_loss, target_signal
from eyas.families.eagle3.ttt import shift_left, ttt_steps
from eyas.sampling import sampling_probs

ANSWER_START = 128  # tokens: what `eyas bench`'s short runs decode of an answer


@dataclass
class Unrolled:
    """One batch's TTT steps scored: each step's result, and per position [B, T] the accepted depth of
    the chain drafted there (0 … K) and whether the position counts (draft 0 predicts an answer token)."""

    steps: list[StepResult]
    depth: torch.Tensor
    counted: torch.Tensor
    expected_depth: dict = field(default_factory=dict)  # per temperature: drafts a drawn chain keeps, expected [B, T]


def drawn_acceptance(logits: torch.Tensor, tempered: torch.Tensor, loss_mask: torch.Tensor, step: int,
                     temperature: float) -> torch.Tensor:
    """α of TTT step ``step`` at every position [B, T] (module docstring): the drafter's ``logits`` [B, T, Vd] against
    the target's distribution at ``temperature`` read at the draft tokens ``tempered`` [B, T, Vd] where the step
    predicts (as :func:`eyas.families.eagle3.loss.step_loss` aligns them); 0 where that is past an answer."""
    shift = 1 + step
    drafter = sampling_probs(logits, temperature)
    kept = torch.minimum(shift_left(tempered, shift), drafter).sum(-1)
    return torch.where(shift_left(loss_mask, shift + 1) > 0, kept, 0.0)


def unroll(drafter, batch, head: torch.Tensor, draft_ids: torch.Tensor, steps: int,
           temperatures: tuple[float, ...] = ()) -> Unrolled:
    """Run the K TTT steps of ``drafter`` on ``batch`` and score them against the target (no gradient); with
    ``temperatures``, also the expected depth of drawn chains at each."""
    signal = target_signal(batch.final, head, draft_ids, temperatures=temperatures)
    counted = shift_left(batch.loss_mask, 2) > 0  # draft 0 at position i predicts token i + 2, an answer token
    alive, depth, results = counted.clone(), torch.zeros(counted.shape, dtype=torch.long, device=counted.device), []
    survive = {t: counted.float() for t in temperatures}  # the chance every draft so far was kept
    expected = {t: torch.zeros(counted.shape, device=counted.device) for t in temperatures}
    for k, logits in enumerate(ttt_steps(drafter, batch.aux, batch.input_ids, steps)):
        results.append(step_loss(logits, signal, batch.loss_mask, k))
        alive &= results[-1].hits  # draft k right where it is counted: an assistant token the draft vocabulary holds
        depth += alive.long()
        for t in temperatures:
            survive[t] = survive[t] * drawn_acceptance(logits, signal.tempered[t], batch.loss_mask, k, t)
            expected[t] += survive[t]
    return Unrolled(results, depth, counted, expected)


def answer_places(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token [B, T]: its index within its assistant answer and that answer's number in its
    row (0 = first); −1 for both outside answers. Answers are the runs of nonzero loss mask."""
    inside = loss_mask > 0
    starts = inside & ~F.pad(inside[:, :-1], (1, 0), value=False)
    index = torch.arange(inside.shape[1], device=inside.device).expand_as(inside)
    start_of_run = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    place = torch.where(inside, index - start_of_run, -1)
    turn = torch.where(inside, starts.long().cumsum(dim=1) - 1, -1)
    return place, turn


@torch.no_grad()
def evaluate(drafter, source, head: torch.Tensor, draft_ids: torch.Tensor, steps: int, step_weights: list[float],
             max_batches: int | None = None, autocast=None, temperatures: tuple[float, ...] = ()) -> dict:
    """Loss, accuracies, acceptance and τ of ``drafter`` on every batch of ``source`` (holdout); with
    ``temperatures``, the simulated τ of drawn chains at each (``tau_at_temperature``, keyed by T as text)."""
    was_training = drafter.training
    drafter.eval()
    positions = 0.0
    accepted = torch.zeros(steps, dtype=torch.float64)
    loss_sum, loss_count = 0.0, 0
    correct, counted = torch.zeros(steps), torch.zeros(steps)
    start_depth, start_positions = 0.0, 0.0
    drawn_depth = dict.fromkeys(temperatures, 0.0)
    for b in range(len(source.batches) if max_batches is None else min(max_batches, len(source.batches))):
        batch = source.batch(b)
        with autocast():
            unrolled = unroll(drafter, batch, head, draft_ids, steps, temperatures)
        for k, result in enumerate(unrolled.steps):
            loss_sum += step_weights[k] * float(result.loss)
            correct[k] += float(result.correct)
            counted[k] += float(result.count)
            accepted[k] += float(((unrolled.depth > k) & unrolled.counted).sum())
        place, turn = (shift_left(x, 2, fill=-1) for x in answer_places(batch.loss_mask))  # the predicted token's
        at_start = unrolled.counted & (turn == 0) & (place < ANSWER_START)
        start_depth += float(unrolled.depth[at_start].sum())
        start_positions += float(at_start.sum())
        positions += float(unrolled.counted.sum())
        for t in temperatures:
            drawn_depth[t] += float(unrolled.expected_depth[t][unrolled.counted].sum())
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
        "tau_answer_start": 1.0 + start_depth / max(start_positions, 1.0),
        **({"tau_at_temperature": {f"{t:g}": 1.0 + d / max(positions, 1.0) for t, d in drawn_depth.items()}}
           if temperatures else {}),
        "positions": positions,
    }
