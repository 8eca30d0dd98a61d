"""The τ training predicts is the τ eyas bench measures (eyas.train.prediction, eyas.families.eagle3.predict).

The rounds' dynamic programming against the rounds themselves (0/1 chances: the exact count; drawn: a simulation of
the process it takes expectations of), then the whole prediction — the target's answers decoded by the engine,
their states captured as training captures them, the drafter's training-time test, the rounds — against the engine's
own chains on the same prompts: at T = 0 τ equal to the last digit, drawn at T = 1 within the spread of the engine's
seeds.
"""

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eyas.data.bench_answers import AnsweredPrompt, answer_as_bench
from eyas.data.benchmarks import Prompt
from eyas.engine.decode import generate
from eyas.engine.target_runner import TargetRunner
from eyas.families.eagle3.predict import predict
from eyas.families.eagle3.runner import DraftRunner
from eyas.speculation import Chain, Sampling
from eyas.target.layout import discover_layout
from eyas.train.data import OnlineSource
from eyas.train.prediction import PredictionSet, expected_rounds, predicted_tau
from test_engine_greedy import constant_pair, prompt_of


def rounds_of(chances: np.ndarray, emitted: int, rng: np.random.Generator) -> tuple[int, int]:
    """One generation's (rounds, accepted drafts), round by round: each draft kept at its chance, the round's first
    refusal ending it."""
    n, rounds, accepted = 1, 0, 0
    while n < emitted:
        kept = 0
        while kept < chances.shape[1] and rng.random() < chances[n, kept]:
            kept += 1
        rounds, accepted, n = rounds + 1, accepted + kept, n + kept + 1
    return rounds, accepted


def test_zero_one_chances_give_the_rounds_exactly():
    rng = np.random.default_rng(0)
    for emitted in (1, 2, 7, 40):
        chances = (rng.random((emitted + 8, 4)) < 0.7).astype(float)
        assert expected_rounds(chances, emitted) == rounds_of(chances, emitted, rng)
    assert expected_rounds(np.ones((20, 3)), 13) == (3.0, 9.0)  # 1 + 4 + 4 + 4 emitted: the last round counts whole


def test_drawn_chances_give_the_expected_rounds():
    rng = np.random.default_rng(1)
    chances, emitted = rng.random((60, 5)), 50
    runs = np.array([rounds_of(chances, emitted, rng) for _ in range(20000)])
    rounds, accepted = expected_rounds(chances, emitted)
    assert runs[:, 0].mean() == pytest.approx(rounds, rel=0.01)
    assert runs[:, 1].mean() == pytest.approx(accepted, rel=0.02)


def test_a_dataset_pools_its_answers_rounds_as_bench_pools_prompts():
    answers = [AnsweredPrompt("d", str(i), 0.0, 0, [1, 2], [5] * 30, None, limit) for limit in (10, 20) for i in range(2)]
    prediction = PredictionSet(answers, None, (2,), (10, 20), 1.0, "eager")
    chances = {a.key: np.full((30, 2), float(a.prompt_id == "0")) for a in answers}  # prompt 0 always kept, 1 never
    rows = {row["max_new_tokens"]: row for row in predicted_tau(prediction, chances)}
    # 10 tokens: 3 rounds keeping 2 each (1 + 3 + 3 + 3), and 9 rounds keeping none
    assert rows[10]["tau"] == pytest.approx(1 + 6 / 12) and rows[10]["answers"] == 2
    assert rows[20]["tau"] == pytest.approx(1 + 14 / (7 + 19))  # each length from its own answers
    stopped = AnsweredPrompt("d", "s", 0.0, 0, [1], [5, 5, 2, 5], 3, 10)
    assert stopped.emitted == 3 and AnsweredPrompt("d", "s", 0.0, 0, [1], [5, 5, 2, 5], 3, 2).emitted == 2


def _target(model):
    return SimpleNamespace(model=model, tokenizer=None, layout=discover_layout(model))


def _prediction(target, drafter, prompts, temperatures, samples, limit, modes="chain:3,chain:5", halves=True):
    answered = []
    for length in (limit // 2, limit) if halves else (limit,):
        more, decoder = answer_as_bench(target, prompts, drafter.config.layer_ids, modes, length, temperatures, samples)
        answered += more
    source = OnlineSource(target, None, None, drafter.config.layer_ids, 4096, torch.device("cpu"), torch.float32,
                          samples=[a.sample() for a in answered])
    prediction = PredictionSet(answered, source, (3, 5), (limit // 2, limit) if halves else (limit,), 1.0, decoder)
    draft_ids = drafter.vocabulary()
    return predict(drafter, prediction, target.layout.lm_head.weight, draft_ids, nullcontext)


def _measured(target, drafter, prompts, depth, limit, sampling):
    rounds = accepted = 0
    for prompt in prompts:
        capacity = len(prompt.input_ids) + limit + depth + 1
        runner = TargetRunner(target.model, target.layout, drafter.config.layer_ids, capacity)
        generation = generate(runner, torch.tensor([prompt.input_ids]), limit, DraftRunner(drafter, capacity + 16),
                              Chain(depth), sampling)
        rounds, accepted = rounds + generation.rounds, accepted + sum(generation.accepted)
    return rounds, accepted


def test_greedy_chains_predicted_are_the_engines_chains():
    """At T = 0 the prediction is the engine's τ itself, chain:3 and chain:5, at both answer lengths."""
    model, layout, drafter = constant_pair()
    target = _target(model)
    prompts = [Prompt("d", str(seed), prompt_of(seed).tolist()[0]) for seed in (11, 12, 13)]
    rows = _prediction(target, drafter, prompts, (0.0,), 1, 40)
    assert len(rows) == 4
    for row in rows:
        rounds, accepted = _measured(target, drafter, prompts, int(row["mode"][6:]), row["max_new_tokens"], Sampling())
        assert 1.2 < row["tau"] < 1 + int(row["mode"][6:]) - 0.2  # partial acceptances: a test that can fail
        assert row["tau"] == pytest.approx(1 + accepted / rounds, abs=1e-9), row


def test_drawn_chains_predicted_are_what_the_engines_draws_average():
    """At T = 1, drafts drawn from the drafter: the τ predicted from 24 answers a prompt is the engine's pooled over 48
    seeds a prompt, within their sampling noise (each ~1.5 % of τ here: 800 answers a prompt came within 0.4 %)."""
    model, layout, drafter = constant_pair()
    target = _target(model)
    prompts = [Prompt("d", str(seed), prompt_of(seed).tolist()[0]) for seed in (11, 12)]
    rows = [row for row in _prediction(target, drafter, prompts, (1.0,), 24, 40, halves=False)
            if row["temperature"] == 1.0]
    assert len(rows) == 2 and all(row["answers"] == 48 for row in rows)
    row = next(row for row in rows if row["mode"] == "chain:3" and row["max_new_tokens"] == 40)
    rounds = accepted = 0
    for seed in range(48):
        r, a = _measured(target, drafter, prompts, 3, 40, Sampling(1.0, 1.0, seed, "probabilistic"))
        rounds, accepted = rounds + r, accepted + a
    assert 1.3 < row["tau"] < 2.5
    assert row["tau"] == pytest.approx(1 + accepted / rounds, abs=0.065)


def _with_prompts(data: str) -> str:
    """``data`` with a holdout whose conversations open with a user's turn (bench's sharegpt-holdout prompts): 8 to
    16 unmasked tokens, then an answer."""
    from pathlib import Path

    from eyas.data.samples import Sample, write_samples

    rng = np.random.default_rng(5)
    samples = []
    for i in range(6):
        prompt, answer = int(rng.integers(8, 17)), int(rng.integers(10, 30))
        ids = rng.integers(3, 250, size=prompt + answer).astype(np.int32)
        samples.append(Sample(f"holdout-{i}", ids, np.r_[np.zeros(prompt), np.ones(answer)].astype(np.uint8)))
    write_samples(samples, Path(data) / "holdout.parquet")
    return data


def test_training_predicts_the_tau_bench_measures(tmp_path, monkeypatch):
    """eyas train --predict on a tiny target: its final evaluation's greedy chains are what eyas bench's engine
    measures with the exported drafter (fp32) on the same prompts, τ for τ; drawn chains are reported beside them. A
    second run on the same target reads the answers back from the eyas cache instead of decoding them again."""
    import json
    from pathlib import Path

    import zoo
    from eyas.bench.run import run_bench
    from eyas.data.benchmarks import load_prompts
    from eyas.engine.loading import load_engine
    from eyas.export.stage import export_run
    from eyas.speculation import parse_modes
    from eyas.train.options import TrainOptions
    from eyas.train.trainer import train

    import eyas.data.bench_answers as bench_answers

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    target = zoo.save_tiny_target(tmp_path / "target")
    data = _with_prompts(zoo.write_data_dir(tmp_path / "data", sizes=(("train", 32), ("holdout", 6)), draft_vocab_size=zoo.VOCAB))
    options = dict(target=target, data=data, online=True, checkpoint_every=40, token_budget=256, lr=3e-3, ttt_steps=3,
                   eval_batches=2, predict=("sharegpt-holdout",), predict_prompts=3, predict_tokens=(12, 24),
                   predict_modes="chain:2,chain:3", predict_samples=2)
    report = train(TrainOptions(out=tmp_path / "run", max_steps=40, **options))
    rows = report.final_eval["predicted"]
    assert len(list((tmp_path / "cache" / "bench-answers").glob("*.json"))) == 2  # one a length
    monkeypatch.setattr(bench_answers, "answer_as_bench", lambda *a, **k: pytest.fail("decoded again"))
    again = train(TrainOptions(out=tmp_path / "again", max_steps=1, **options))
    assert again.initial_eval["predicted"] == report.initial_eval["predicted"]
    assert {(r["mode"], r["temperature"], r["max_new_tokens"]) for r in rows} == {
        (m, t, n) for m in ("chain:2", "chain:3") for t in (0.0, 1.0) for n in (12, 24)}
    export_run(tmp_path / "run", tmp_path / "draft", dtype="fp32")
    card = (tmp_path / "draft" / "README.md").read_text()
    chain3 = next(r["tau"] for r in rows if (r["mode"], r["temperature"], r["max_new_tokens"]) == ("chain:3", 1.0, 24))
    assert "## The τ eyas bench will measure" in card and "| sharegpt-holdout | chain:3 drawn | 1 | 3 |" in card
    assert f"{chain3:.2f} |" in card
    engine = load_engine(target, tmp_path / "draft", 160, "cpu", dtype="fp32", modes=parse_modes("chain:2,chain:3"))
    prompts, _ = load_prompts(["sharegpt-holdout"], None, data, 3, 1024)
    greedy = [r for r in rows if r["temperature"] == 0.0]
    assert max(r["tau"] for r in greedy) > 1.2  # the drafter learnt something to predict
    for tokens in (12, 24):
        measured = run_bench(engine.target_runner, engine.draft_runner, prompts, parse_modes("chain:2,chain:3"),
                             [Sampling()], tokens, engine.stop_ids).datasets["sharegpt-holdout"]
        for result in measured[1:]:
            row = next(r for r in greedy if r["mode"] == result.mode and r["max_new_tokens"] == tokens)
            assert row["tau"] == pytest.approx(result.tau, abs=1e-9), (row, result.tau)
    engine.target_runner.close()

    # benchmarks/predict_vs_bench.py --predicted RUN_DIR: the run's own predictions (its card's) against bench's loop
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import predict_vs_bench

    monkeypatch.setattr("sys.argv", ["predict_vs_bench.py", "--target", str(target), "--draft", str(tmp_path / "draft"),
                                     "--data", str(data), "--predicted", str(tmp_path / "run"), "--seeds", "1",
                                     "--device", "cpu", "--dtype", "fp32", "--no-compile", "--out", str(tmp_path / "pvb.json")])
    predict_vs_bench.main()
    compared = json.loads((tmp_path / "pvb.json").read_text())["rows"]
    assert len(compared) == len(rows) and {r["tau"] for r in compared} == {r["tau"] for r in rows}
    for row in (r for r in compared if r["temperature"] == 0.0):
        assert row["bench"] == pytest.approx(row["tau"], abs=1e-9), row
    assert all(r["bench"] > 1 for r in compared if r["temperature"] > 0)  # drawn chains measured too


@pytest.mark.parametrize("flags, said", [
    (["--features", "F"], "--predict answers bench's prompts with the target"),
    (["--data", "D", "--stream"], "it needs --online"),
    (["--data", "D", "--predict-modes", "tree:10,3,4"], "--predict-modes tree:10,3,4: must be chain:K"),
    (["--data", "D", "--predict-tokens", "0"], "--predict-tokens"),
])
def test_predict_refuses_what_it_cannot_predict_in_one_line(flags, said, tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app

    result = CliRunner().invoke(app, ["train", "--target", "demo", "--out", str(tmp_path / "run"),
                                      "--predict", "mt-bench", *flags])
    assert result.exit_code != 0
    assert said in result.output.replace("\n", " ") or said in str(result.exception), result.output


def test_the_objective_table_names_each_run_by_what_differs_and_lays_out_its_predictions(tmp_path, monkeypatch):
    """benchmarks/objective_table.py: the first run is the baseline, every other one named by the started options it
    sets unlike the baseline (not by its step limits or out directory; a path by its last component), one line per
    dataset, a column per chain, temperature and length."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import objective_table

    def run(name, objective, tau, data="/data/t0-all"):
        directory = tmp_path / name
        directory.mkdir()
        options = {"out": str(directory), "max_steps": 10, "objective": objective, "lr": 0.003, "data": data,
                   "segments": [{"step": 0}]}
        (directory / "train_options.json").write_text(json.dumps(options))
        predicted = [{"dataset": d, "mode": "chain:5", "temperature": t, "max_new_tokens": n, "tau": tau + t + n / 1000}
                     for d in ("mt-bench", "humaneval") for t in (0.0, 1.0) for n in (256, 512)]
        (directory / "report.json").write_text(json.dumps({"tokens": 1000, "final_eval": {"tau": 3.0,
                                                                                          "predicted": predicted}}))
        return directory

    text = objective_table.table([run("a", "kl", 2.0), run("b", "lk-lambda", 2.5), run("c", "kl", 2.0, "/data/mix-all")])
    lines = text.splitlines()
    assert lines[0].startswith("| run | variant | tokens | holdout τ | dataset | chain:5 T=0 @256 | chain:5 T=0 @512 |")
    assert "| a | base | 1,000 | 3.00 | mt-bench | 2.26 | 2.51 | 3.26 | 3.51 |" in lines
    assert "| b | --objective lk-lambda | 1,000 | 3.00 | humaneval | 2.76 | 3.01 | 3.76 | 4.01 |" in lines
    assert "| c | --data mix-all | 1,000 | 3.00 | mt-bench | 2.26 | 2.51 | 3.26 | 3.51 |" in lines
    assert len(lines) == 2 + 6


def test_predict_without_a_holdout_is_refused_before_anything_is_decoded(tmp_path, monkeypatch):
    """--predict reports with the holdout's evaluations: a DATA_DIR without a holdout split is refused in one line
    before a single answer is decoded (on every rank alike)."""
    import zoo
    import eyas.data.bench_answers as bench_answers
    from eyas.errors import EyasError
    from eyas.train.options import TrainOptions
    from eyas.train.trainer import train

    monkeypatch.setattr(bench_answers, "answer_as_bench", lambda *a, **k: pytest.fail("decoded"))
    target = zoo.save_tiny_target(tmp_path / "target")
    data = zoo.write_data_dir(tmp_path / "data", sizes=(("train", 8),))
    with pytest.raises(EyasError, match="no holdout split: prepare DATA_DIR with --holdout, or leave --predict out"):
        train(TrainOptions(target=target, out=tmp_path / "run", data=data, online=True, max_steps=1, token_budget=256,
                           ttt_steps=2, predict=("sharegpt-holdout",)))


def test_runs_side_by_side_answer_the_prompts_once(tmp_path, monkeypatch):
    """A second process reaching the same answers' key while the first decodes waits for its cache, and reads it."""
    import os
    import subprocess
    import sys
    import time

    from eyas.data.bench_answers import answering_alone, cached_answers, keep_answers

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    answer = AnsweredPrompt(dataset="mt-bench", prompt_id="1", temperature=0.0, seed=0, prompt=[1, 2], answer=[3, 4],
                            stop_at=None, limit=2)
    holder = ("import sys, time\nfrom eyas.data.bench_answers import answering_alone\nwith answering_alone('k'):\n"
              "    print('held', flush=True)\n    time.sleep(3)\n")
    first = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "EYAS_CACHE": str(tmp_path / "cache")})
    assert first.stdout.readline().strip() == "held"
    start = time.monotonic()
    with answering_alone("k"):  # blocks until the other process lets go
        waited = time.monotonic() - start
        assert cached_answers("k") is None
        keep_answers("k", [answer], "graphs")
    first.wait(timeout=30)
    assert waited > 1.5
    with answering_alone("k"):
        assert cached_answers("k") == ([answer], "graphs")
    with answering_alone(None):  # no key: nothing kept, nothing locked
        assert cached_answers(None) is None
