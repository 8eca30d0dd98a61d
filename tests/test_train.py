"""The trainer: stopped and resumed ends with the same weights; online equals offline; it learns."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zoo
from eyas.train.options import TrainOptions
from eyas.train.trainer import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return zoo.tiny_store(tmp_path_factory.mktemp("train"))


def opts(target, out, **overrides):
    base = dict(target=target, out=Path(out), max_steps=6, token_budget=256, checkpoint_every=2, lr=1e-3, ttt_steps=3,
                eval_batches=2)
    return TrainOptions(**{**base, **overrides})


def test_a_finished_run_resumed_trains_nothing_and_keeps_its_weights_and_final_evaluation(setup, tmp_path):
    """What a rerun of `eyas run` does (kill -9 then resume: test_kill_resume.py)."""
    target, _, features = setup
    clean = train(opts(target, tmp_path / "clean", features=features))
    assert clean.steps == 6
    a = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in a and "embed_tokens.weight" not in a
    again = train(opts(target, tmp_path / "clean", features=features, resume=True))
    assert (again.resumed_from, again.steps) == (6, 6) and again.final_eval == clean.final_eval != {}
    for name, tensor in load_file(tmp_path / "clean" / "final" / "model.safetensors").items():
        assert torch.equal(tensor, a[name]), name


TERMINATE_DURING_STEP_3 = textwrap.dedent("""
    import os, signal, sys
    import eyas.families.eagle3.objective as objective
    from eyas.cli import app
    real, calls = objective.step_loss, []

    def loss_then_term(*args, **kwargs):  # 3 TTT steps a batch: call 7 is step 3's first
        calls.append(1)
        if len(calls) == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    objective.step_loss = loss_then_term
    app(sys.argv[1:])
""")


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_finishes_the_same(setup, tmp_path):
    """A scheduler's time limit or ``timeout`` sends SIGTERM: the run ends after the current step with a
    checkpoint (step 3, between the regular ones at 2 and 4), and resuming it ends where an
    uninterrupted run ends."""
    target, _, features = setup
    clean = train(opts(target, tmp_path / "clean", features=features))
    script = tmp_path / "term.py"
    script.write_text(TERMINATE_DURING_STEP_3)
    args = ["train", "--target", target, "--features", str(features), "--out", str(tmp_path / "stopped"), "--max-steps", "6",
            "--token-budget", "256", "--checkpoint-every", "2", "--lr", "1e-3", "--ttt-steps", "3", "--eval-batches", "2"]
    stopped = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert "stopped by SIGTERM after step 3" in stopped.stdout and "--resume" in stopped.stdout
    assert (tmp_path / "stopped" / "checkpoints" / "step-00000003").is_dir()
    assert not (tmp_path / "stopped" / "final").exists()
    resumed = train(opts(target, tmp_path / "stopped", features=features, resume=True))
    assert resumed.resumed_from == 3 and resumed.steps == clean.steps == 6
    zoo.assert_same_final_weights(tmp_path / "clean", tmp_path / "stopped")


def test_online_training_equals_offline(setup, tmp_path):
    target, data, features = setup
    offline = train(opts(target, tmp_path / "off", features=features, max_steps=4, checkpoint_every=4))
    online = train(opts(target, tmp_path / "on", data=data, online=True, max_steps=4, checkpoint_every=4))
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    for a, b in zip(read(tmp_path / "off")[1:], read(tmp_path / "on")[1:], strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    a = load_file(tmp_path / "off" / "final" / "model.safetensors")
    b = load_file(tmp_path / "on" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    assert offline.final_eval["loss"] == pytest.approx(online.final_eval["loss"], rel=1e-5)


def test_split_attention_trains_what_scores_train_and_a_resume_may_switch_to_it(setup, tmp_path, monkeypatch):
    """--attention split (eyas.families.eagle3.split_attention) reaches the trainer: the same per-step losses as the written-out
    scores, and a run begun with one resumes with the other (the same arithmetic, so RESUMABLE)."""
    import eyas.families.eagle3.ttt as ttt

    target, _, features = setup
    calls, real = [], ttt.attend_split
    monkeypatch.setattr(ttt, "attend_split", lambda *args: calls.append(1) or real(*args))
    for max_steps in (2, 4):  # the reference: the same two segments (a resume stretches the schedule to its new end)
        train(opts(target, tmp_path / "scores", features=features, max_steps=max_steps, checkpoint_every=2,
                   attention="scores", resume=max_steps == 4))
    split = train(opts(target, tmp_path / "split", features=features, max_steps=2, checkpoint_every=2, attention="split"))
    assert split.steps == 2 and len(calls) >= 2 * 2  # steps 1 and 2 of the unroll, in each of two optimizer steps
    monkeypatch.undo()
    resumed = train(opts(target, tmp_path / "split", features=features, max_steps=4, checkpoint_every=2,
                         attention="scores", resume=True))
    assert resumed.resumed_from == 2 and resumed.steps == 4
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    losses = lambda run: [(m["step"], m["loss"]) for m in read(run) if "loss" in m]  # noqa: E731
    for (step_a, a), (step_b, b) in zip(losses(tmp_path / "scores"), losses(tmp_path / "split"), strict=True):
        assert step_a == step_b and a == pytest.approx(b, rel=1e-5)
    options = json.loads((tmp_path / "split" / "train_options.json").read_text())
    assert any(seg.get("changed", {}).get("attention") == {"from": "split", "to": "scores"} for seg in options["segments"]), \
        options["segments"]


@pytest.mark.parametrize("objective", ["kl", "lk-lambda", "lk-alpha", "hass"])
def test_learning_lowers_holdout_loss_and_lifts_step0_acceptance(setup, tmp_path, objective):
    """Under every --objective; the holdout's loss is the kl's whatever the objective (comparable between them), which
    lk-alpha, aiming at α alone, need not lower."""
    target, _, features = setup
    report = train(opts(target, tmp_path / "learn", features=features, max_steps=40, checkpoint_every=40, lr=3e-3,
                        eval_batches=None, objective=objective))
    first, last = report.initial_eval, report.final_eval
    assert last["loss"] < first["loss"] or objective == "lk-alpha"
    assert last["acceptance_cumulative"][0] > first["acceptance_cumulative"][0]
    assert last["tau"] == pytest.approx(1 + sum(last["acceptance_cumulative"]))


def test_batches_are_rounded_to_a_multiple_of_64_tokens_on_a_gpu_within_the_budget_and_the_padding_changes_nothing(
        setup, tmp_path):
    """On CUDA batch widths come in steps of SHAPE_MULTIPLE (attention graphs are built per shape); the extra padding
    sits right of every real token, so a step's loss, tallies and gradients are those of the unrounded batch."""
    import dataclasses

    from eyas.train.data import SHAPE_MULTIPLE, OfflineSource, batch_width, plan_batches, width_multiple
    from eyas.families.eagle3.objective import micro_batch
    from eyas.train.trainer import setup_training, training_autocast

    assert (width_multiple("cuda"), width_multiple("cpu")) == (SHAPE_MULTIPLE, 1) and SHAPE_MULTIPLE == 64
    lengths = [5, 64, 65, 130, 200, 17, 300, 63, 128]
    for budget in (128, 256, 1024):
        for batch in plan_batches(lengths, budget, 64):
            longest = max(lengths[i] for i in batch)
            width = batch_width(longest, 64)
            assert width % 64 == 0 and longest <= width < longest + 64
            assert len(batch) == 1 or len(batch) * width <= budget  # the budget counts the rounded width
    assert [batch_width(n, 64) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 192]
    assert plan_batches(lengths, 256, 1) != plan_batches(lengths, 256, 64)  # the plan counts the rounded widths

    target, _, features = setup
    rounded = OfflineSource(features, "train", 256, torch.device("cpu"), torch.float32, multiple=64)
    plain = OfflineSource(features, "train", 256, torch.device("cpu"), torch.float32)  # the CPU's own: unrounded
    for source, multiple in ((rounded, 64), (plain, 1)):
        for index in range(len(source.batches)):
            batch = source.batch(index)
            real = [int(n) for n in batch.valid.sum(1)]
            assert batch.input_ids.shape[1] == batch_width(max(real), multiple) == batch.aux.shape[1]

    options = opts(target, tmp_path / "run", features=features)
    parts = setup_training(options, torch.device("cpu"))
    drafter, head, draft_ids = parts.drafter, parts.head, parts.draft_ids
    weights = [options.step_decay**k for k in range(options.ttt_steps)]
    batch = plain.batch(0)
    pads = {"aux": (0, 0, 0, 64), "final": (0, 0, 0, 64), "input_ids": (0, 64), "loss_mask": (0, 64), "valid": (0, 64)}
    wider = dataclasses.replace(batch, **{name: torch.nn.functional.pad(getattr(batch, name), pad)
                                          for name, pad in pads.items()})
    results = []
    for one in (batch, wider):
        drafter.zero_grad(set_to_none=True)
        tallies = tuple(torch.zeros(options.ttt_steps) for _ in range(3))
        tokens = micro_batch(drafter, one, head, draft_ids, options, weights, training_autocast(torch.device("cpu")), tallies)
        results.append((tokens, tallies, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (tokens, tallies, grads), (tokens_w, tallies_w, grads_w) = results
    assert tokens == tokens_w and grads.keys() == grads_w.keys() and grads
    for a, b in zip(tallies, tallies_w, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_w[name], rtol=1e-4, atol=1e-6)


def test_final_weights_are_the_last_checkpoints_file_under_a_second_name_and_outlive_it(setup, tmp_path, monkeypatch):
    """A finished run takes its checkpoint's disk alone (issue 48: a streamed run keeps no store and no second copy of
    its weights): the final weights are the last step's checkpoint file under a second name; weights that file does not
    hold exactly, or a filesystem without hard links, get a file of their own."""
    import os
    import shutil

    from eyas.train.checkpoint import checkpointed_weights

    target, _, features = setup
    train(opts(target, tmp_path / "run", features=features, keep=1))
    final = tmp_path / "run" / "final" / "model.safetensors"
    kept = tmp_path / "run" / "checkpoints" / "step-00000006" / "model.safetensors"
    assert os.stat(final).st_ino == os.stat(kept).st_ino and os.stat(final).st_nlink == 2
    weights = load_file(final)
    assert checkpointed_weights(tmp_path / "run", weights) == kept
    name = next(iter(weights))
    for changed in ({**weights, name: weights[name] + 1}, {**weights, name: weights[name].double()},
                    {k: v for k, v in weights.items() if k != name}, {**weights, "extra": weights[name]}):
        assert checkpointed_weights(tmp_path / "run", changed) is None
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # a later rotation, or a user, removes the checkpoint
    assert os.stat(final).st_nlink == 1 and checkpointed_weights(tmp_path / "run", weights) is None
    assert all(torch.equal(tensor, weights[name]) for name, tensor in load_file(final).items())

    def no_links(*args):
        raise OSError("hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    train(opts(target, tmp_path / "copied", features=features, keep=1))
    final = tmp_path / "copied" / "final" / "model.safetensors"
    assert os.stat(final).st_nlink == 1
    assert final.read_bytes() == (tmp_path / "copied" / "checkpoints" / "step-00000006" / "model.safetensors").read_bytes()
