"""The holdout evaluation's bookkeeping: where each token sits in its answer, and the two simulated τ
(all answer tokens; the start of first answers, what a short bench decodes) from the accepted depths."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import eyas.train.evaluate as evaluate_module
from eyas.drafter.loss import StepResult
from eyas.train.evaluate import Unrolled, answer_places, evaluate


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
