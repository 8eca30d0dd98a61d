"""The holdout evaluation's bookkeeping: where each token sits in its answer, and the two simulated τ
(all answer tokens; the start of first answers, what a short bench decodes) from the accepted depths."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import eyas.families.eagle3.evaluate as evaluate_module
from eyas.families.eagle3.loss import StepResult
from eyas.families.eagle3.evaluate import Unrolled, answer_places, evaluate


def test_answer_places_number_each_answer_and_each_token_in_it():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0],
                         [1, 1, 0, 0, 0, 0, 0, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    place, turn = answer_places(mask)
    assert place.tolist() == [[-1, -1, 0, 1, 2, -1, 0, 1, -1], [0, 1, -1, -1, -1, -1, -1, 0, 1], [-1] * 9]
    assert turn.tolist() == [[-1, -1, 0, 0, 0, -1, 1, 1, -1], [0, 0, -1, -1, -1, -1, -1, 1, 1], [-1] * 9]


def test_tau_at_the_answer_start_averages_only_the_first_answers_first_tokens(monkeypatch):
    monkeypatch.setattr(evaluate_module, "ANSWER_START", 2)
    # prompt token 0; first answer tokens 1-4; a break; second answer tokens 6-8
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0]])
    counted = evaluate_module.shift_left(mask, 2) > 0  # the chain drafted at i starts at token i + 2
    assert counted[0].nonzero().flatten().tolist() == [0, 1, 2, 4, 5, 6]
    depth = torch.tensor([[3, 1, 0, 2, 0, 5, 4, 2, 0, 0, 0]])  # accepted depth of the chain drafted at i
    steps = 5
    result = StepResult(loss=torch.tensor(0.0), correct=torch.tensor(0), count=torch.tensor(1.0),
                        hits=torch.zeros_like(counted))
    monkeypatch.setattr(evaluate_module, "unroll", lambda *a: Unrolled([result] * steps, depth, counted))
    source = SimpleNamespace(batches=[0], batch=lambda b: SimpleNamespace(loss_mask=mask))
    out = evaluate(torch.nn.Linear(1, 1), source, None, None, steps, [1.0] * steps, autocast=nullcontext)
    # the first answer's first 2 tokens (1, 2) are where the chains drafted at −1 and 0 start: only 0 counts
    assert out["tau_answer_start"] == pytest.approx(1 + 3)
    # every counted position (3 and 7 are not: their chains start outside answers)
    assert out["tau"] == pytest.approx(1 + (3 + 1 + 0 + 0 + 5 + 4) / 6)
    assert out["acceptance_cumulative"] == pytest.approx([4 / 6, 3 / 6, 3 / 6, 2 / 6, 1 / 6])


def test_drawn_acceptance_is_what_the_engine_keeps_of_a_drawn_draft():
    """α of a TTT step at a position = Σ min(p_T, q_T) over the draft vocabulary, read where the step predicts (one
    place further per step) and 0 past the answer; and it is the rate at which the engine's rule (chain_sampled) keeps
    a draft drawn from the drafter's q_T, mapped to target ids."""
    from eyas.families.eagle3.loss import target_signal
    from eyas.engine.acceptance import chain_sampled, draw

    gen = torch.Generator().manual_seed(3)
    vocab, width, tokens, temperature = 7, 5, 6, 0.8
    draft_ids = torch.tensor([0, 2, 3, 5])  # the target's tokens 1, 4 and 6 cannot be drafted
    head, final = torch.randn(vocab, width, generator=gen), torch.randn(1, tokens, width, generator=gen) * 2
    logits = torch.randn(1, tokens, len(draft_ids), generator=gen) * 2
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]])
    signal = target_signal(final, head, draft_ids, temperatures=(temperature,))
    full = torch.softmax(final[0] @ head.T / temperature, -1)  # the target's sampling distribution at each token
    for step in (0, 1):
        alpha = evaluate_module.drawn_acceptance(logits, signal.tempered[temperature], mask, step, temperature)[0]
        for i in range(tokens):
            q = torch.softmax(logits[0, i] / temperature, -1)
            where = i + 1 + step  # the target's distribution the step's draft at i is judged against
            inside = where + 1 < tokens and mask[0, where + 1] > 0
            expected = torch.minimum(full[where, draft_ids], q).sum() if inside else torch.tensor(0.0)
            assert alpha[i] == pytest.approx(float(expected), abs=1e-6), (step, i)
    # the engine's rule keeps a drawn draft at that rate
    p, q_draft = full[2], torch.softmax(logits[0, 1] / temperature, -1)
    q = torch.zeros(vocab).index_copy_(0, draft_ids, q_draft)
    runs, kept = 20000, 0
    for _ in range(runs):
        drafted = draft_ids[draw(q_draft, torch.rand((), generator=gen))].view(1)
        accepted, _ = chain_sampled(drafted, torch.stack([p, p]), q.view(1, -1), torch.rand(2, generator=gen))
        kept += int(accepted)
    alpha = float(evaluate_module.drawn_acceptance(logits, signal.tempered[temperature], mask, 0, temperature)[0, 1])
    assert kept / runs == pytest.approx(alpha, abs=0.015)
