"""`eyas train --drafter dspark`: the DSpark drafter from the same store (or online target) EAGLE-3 and DFlash train on; it
learns, resumes exactly, and exports to the directory vLLM's dspark method loads."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import eyas.families.dspark.objective as objective
import zoo
from eyas.cli import app
from eyas.errors import EyasError
from eyas.export.check import check_draft_dir
from eyas.export.fit import TargetSizes
from eyas.export.stage import export_run
from eyas.target.loading import load_target_config
from eyas.train.options import TrainOptions
from eyas.train.trainer import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return zoo.tiny_store(tmp_path_factory.mktemp("train-dspark"))


def opts(target, out, **overrides):
    base = dict(target=target, out=Path(out), drafter="dspark", spark_block=3, draft_layers=2, markov_rank=16, max_steps=6,
                token_budget=256, checkpoint_every=2, lr=3e-3, eval_batches=2)
    return TrainOptions(**{**base, **overrides})


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_dspark_run_learns_and_exports_what_vllm_loads(setup, tmp_path):
    target, _, features = setup
    report = train(opts(target, tmp_path / "run", features=features, max_steps=40, checkpoint_every=40,
                        eval_batches=None))
    first, last = report.initial_eval, report.final_eval
    assert last["loss"] < first["loss"] and sum(last["accuracy"]) > sum(first["accuracy"])
    assert last["tau"] >= 1.0 and len(last["accuracy"]) == 3  # block 3: three slots, each a proposal
    assert 1.0 <= last["tau_drawn"] <= 4.0 and last["tau_drawn"] > first["tau_drawn"]
    recorded = json.loads((tmp_path / "run" / "final" / "drafter_config.json").read_text())
    assert recorded["drafter"] == "dspark" and recorded["layer_ids"] == [2, 4, 5]  # the store's taps
    step = read_metrics(tmp_path / "run")[-1]
    assert step["loss"] == pytest.approx(sum(step["step_loss"]), rel=1e-5)  # each slot's share of the loss

    draft = export_run(tmp_path / "run", tmp_path / "draft", "fp32")  # --format auto: the run's family
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 3
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 4] and "eagle_config" not in config
    assert config["markov_rank"] == 16 and config["sample_from_anchor"] is True
    result = check_draft_dir(draft, TargetSizes.of(load_target_config(target)[0]))
    assert result.ok, result.errors
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    exported = load_file(draft / "model.safetensors")
    assert set(exported) == set(final) and all(torch.equal(exported[n], final[n]) for n in final)
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in exported)  # the target's, shared
    card = (draft / "README.md").read_text()
    assert "vllm serve" in card and '"method": "dspark"' in card and '"num_speculative_tokens": 3' in card
    with pytest.raises(EyasError, match="--format dspark"):
        export_run(tmp_path / "run", tmp_path / "wrong", "fp32", "eagle3")


def test_a_dspark_run_stopped_mid_run_resumes_to_the_same_weights(setup, tmp_path, monkeypatch):
    """Anchors are drawn from a generator seeded by the batch's place in the run: the resumed steps draw the blocks an
    uninterrupted run draws, so the weights end equal."""
    target, _, features = setup
    train(opts(target, tmp_path / "clean", features=features))
    calls, real = [], objective.spark_micro_batch

    def crash_in_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "spark_micro_batch", crash_in_step_5)
    with pytest.raises(RuntimeError, match="killed"):
        train(opts(target, tmp_path / "stopped", features=features))
    monkeypatch.undo()
    resumed = train(opts(target, tmp_path / "stopped", features=features, resume=True))
    assert resumed.resumed_from == 4 and resumed.steps == 6
    zoo.assert_same_final_weights(tmp_path / "clean", tmp_path / "stopped")


def test_online_dspark_training_equals_offline(setup, tmp_path):
    target, data, features = setup
    offline = train(opts(target, tmp_path / "off", features=features, max_steps=3, checkpoint_every=3))
    online = train(opts(target, tmp_path / "on", data=data, online=True, max_steps=3, checkpoint_every=3))
    for a, b in zip(read_metrics(tmp_path / "off")[1:], read_metrics(tmp_path / "on")[1:], strict=True):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert offline.final_eval["tau"] == pytest.approx(online.final_eval["tau"])


def test_the_command_line_trains_a_dspark_drafter_and_refuses_what_it_cannot(setup, tmp_path):
    target, _, features = setup
    base = ["train", "--target", target, "--features", str(features), "--drafter", "dspark", "--spark-block", "3",
            "--draft-layers", "1", "--max-steps", "2", "--token-budget", "256", "--eval-batches", "1"]
    ran = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "cli")])
    assert ran.exit_code == 0, ran.output
    assert json.loads((tmp_path / "cli" / "drafter_config.json").read_text())["num_hidden_layers"] == 1
    outside = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "bad"), "--mask-token-id", "100000"])
    assert outside.exit_code != 0 and "outside the target's vocabulary" in outside.output
    dflash_flag = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "flag"), "--block-size", "8"])
    assert dflash_flag.exit_code == 2 and "--block-size is an option of dflash drafters" in dflash_flag.output
    long = CliRunner().invoke(app, [*base[:-2], "--out", str(tmp_path / "long"), "--spark-block", "500"])
    assert long.exit_code == 2 and "--spark-block 500" in long.output and not (tmp_path / "long").exists()
    sharded = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "fsdp"), "--fsdp"])
    assert sharded.exit_code != 0 and "--fsdp" in sharded.output
    confident = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "conf"), "--confidence-head"])
    assert confident.exit_code == 0, confident.output
    assert json.loads((tmp_path / "conf" / "drafter_config.json").read_text())["confidence_head"] is True
    draft = export_run(tmp_path / "conf", tmp_path / "conf-draft", "fp32")
    assert json.loads((draft / "config.json").read_text())["enable_confidence_head"] is True
    assert "confidence_head.proj.weight" in load_file(draft / "model.safetensors")
    flash = ["train", "--target", target, "--features", str(features), "--drafter", "dflash", "--max-steps", "1"]
    unread = CliRunner().invoke(app, [*flash, "--out", str(tmp_path / "unread"), "--confidence-head"])
    assert unread.exit_code == 2 and "--confidence-head is an option of dspark drafters" in unread.output
