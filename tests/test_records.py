"""Honest records: a resumed run counts all its segments, a resume cannot change what the run is, and the model card's
serve commands run as written."""

import json
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app
from eyas.export.card import serve_target
from eyas.target.facts import target_facts
from eyas.train.options import TrainOptions
from eyas.train.trainer import train

SMALL = dict(max_steps=2, token_budget=256, checkpoint_every=2, ttt_steps=2, eval_batches=1, lr=1e-3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny target and store; a run trained in two segments (2 steps, then resumed with --max-steps 4) beside one
    trained 4 steps at once."""
    root = tmp_path_factory.mktemp("records")
    target, data, features = zoo.tiny_store(root, sizes=(("train", 12), ("holdout", 2)))
    train(TrainOptions(target=target, out=root / "whole", features=features, **{**SMALL, "max_steps": 4}))
    train(TrainOptions(target=target, out=root / "resumed", features=features, **SMALL))
    train(TrainOptions(target=target, out=root / "resumed", features=features, resume=True, **{**SMALL, "max_steps": 4}))
    return root, target, data, features


def read_json(path):
    return json.loads(Path(path).read_text())


def snapshot(directory):
    """Every file under ``directory`` with its bytes: what a refused command must leave as it was."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def refused(args, directory):
    """Run the CLI; assert exit 2 with one error line, last (eyas run prints its stage headers before), and that
    ``directory`` is byte for byte as before; return the line."""
    before = snapshot(directory)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    line = lines[-1]
    assert line.startswith("error:") and [x for x in lines if "error" in x] == [line], result.output
    assert snapshot(directory) == before
    return line


def test_a_resumed_run_reports_the_tokens_and_initial_evaluation_of_all_its_segments(runs):
    root, *_ = runs
    report, whole = read_json(root / "resumed" / "report.json"), read_json(root / "whole" / "report.json")
    logged = [json.loads(line) for line in (root / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 1, 2, 3, 4]
    assert report["steps"] == 4 and report["resumed_from"] == 2
    assert report["tokens"] == sum(line.get("tokens", 0) for line in logged) == whole["tokens"] > 0
    assert report["initial_eval"] == logged[0]["eval"] == whole["initial_eval"] != {}
    assert report["seconds"] > 0


def test_train_options_keep_what_the_run_started_with_and_each_resume_s_changes(runs):
    root, _, _, features = runs
    record = read_json(root / "resumed" / "train_options.json")
    assert record["max_steps"] == 2 and record["resume"] is False  # as the run started, never rewritten
    first, second = record["segments"]
    assert first["step"] == 0 and second["step"] == 2
    assert second["changed"] == {"max_steps": {"from": 2, "to": 4}}
    assert second["data"]["role"] == "features" and second["data"]["path"] == str(features)
    assert second["data"]["sha256"] == read_json(root / "resumed" / "manifest.json")["inputs"][0]["sha256"]


def train_args(target, out, *data, **flags):
    """``eyas train --resume`` of a SMALL run with ``flags`` (``lr="0.002"`` → ``--lr 0.002``) over SMALL's values."""
    values = {**{k: str(v) for k, v in SMALL.items()}, "max_steps": "4", **flags}
    return ["train", "--target", target, *data, "--out", str(out), "--resume",
            *(item for name, value in values.items() for item in ("--" + name.replace("_", "-"), value))]


def test_a_resume_that_changes_what_the_run_is_is_refused_with_the_option_and_both_values(runs, tmp_path):
    root, target, _, features = runs
    run = tmp_path / "run"
    shutil.copytree(root / "resumed", run)
    data = ("--features", str(features))
    for name, new, old in [("lr", "0.002", "0.001"), ("ttt_steps", "3", "2"), ("token_budget", "512", "256"),
                           ("seed", "1", "0"), ("eval_batches", "2", "1"), ("weight_decay", "0.1", "0.0")]:
        flag = "--" + name.replace("_", "-")
        line = refused(train_args(target, run, *data, **{name: new}), run)
        assert str(run) in line and f"trained with {flag} {old}; this resume gives {flag} {new}" in line, line
        assert "--max-steps" in line and "new --out" in line, line
    line = refused(train_args(target, run, *data, layer_ids="1,3,5"), run)
    assert "trained without --layer-ids; this resume gives --layer-ids 1,3,5" in line and "resume without --layer-ids" in line
    line = refused(train_args(target, run, *data, max_steps="3"), run)  # below the step the run is at
    assert "is at step 4, past the 3 steps" in line and "--max-steps 4" in line, line


def test_a_resume_reads_moved_data_by_content_and_refuses_other_data(runs, tmp_path):
    """Online from a DATA_DIR: the same DATA_DIR moved resumes (its new path recorded); another DATA_DIR, or
    FEATURES_DIR instead, is refused."""
    root, target, data, features = runs
    train(TrainOptions(target=target, out=tmp_path / "run", data=Path(data), online=True, **SMALL))
    moved = Path(shutil.copytree(data, tmp_path / "moved-data"))
    report = train(TrainOptions(target=target, out=tmp_path / "run", data=moved, online=True, resume=True,
                                **{**SMALL, "max_steps": 3}))
    assert (report.resumed_from, report.steps) == (2, 3)
    changes = read_json(tmp_path / "run" / "train_options.json")["segments"][-1]["changed"]
    assert changes == {"max_steps": {"from": 2, "to": 3}, "data": {"from": str(data), "to": str(moved)}}
    other = zoo.write_data_dir(tmp_path / "other-data", sizes=(("train", 12), ("holdout", 2)), seed=1)
    run = tmp_path / "run"
    line = refused(train_args(target, run, "--data", other, "--online", max_steps="3"), run)
    assert f"trained from --data {moved}; this resume gives --data {other}" in line, line
    shutil.rmtree(moved)
    shutil.copytree(other, moved)  # other data in the recorded place
    line = refused(train_args(target, run, "--data", str(moved), "--online", max_steps="3"), run)
    assert "its manifest.json differs" in line, line
    line = refused(train_args(target, run, "--features", str(features), max_steps="3"), run)
    assert f"this resume gives --features {features}" in line, line


def test_a_resume_finds_a_moved_target_by_content_and_refuses_another_one(runs, tmp_path):
    """The target copied elsewhere (its old path gone) resumes, its new path recorded; a target of the same sizes
    and config with another embedding, given at the recorded path, is refused before anything is written."""
    from safetensors.torch import load_file, save_file

    root, target, _, features = runs
    run = Path(shutil.copytree(root / "resumed", tmp_path / "run"))
    moved = Path(shutil.copytree(target, tmp_path / "moved-target"))
    report = train(TrainOptions(target=str(moved), out=run, features=features, resume=True, **{**SMALL, "max_steps": 5}))
    assert (report.resumed_from, report.steps) == (4, 5)
    segment = read_json(run / "train_options.json")["segments"][-1]
    assert segment["changed"] == {"max_steps": {"from": 4, "to": 5}, "out": {"from": str(root / "resumed"), "to": str(run)},
                                  "target": {"from": str(target), "to": str(moved)}}
    assert segment["target"]["spec"] == str(moved) and segment["target"]["weights_sha256"]
    weights = next(moved.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k in tensors if "embed_tokens" in k)
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, weights, metadata={"format": "pt"})
    line = refused(train_args(str(moved), run, "--features", str(features), max_steps="6"), run)
    assert f"trained against --target {moved}; this resume gives --target {moved}, another target" in line, line
    assert "embedding, lm_head or final norm differ" in line, line


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_removing_it_resumes_from_the_one_before(runs, tmp_path):
    root, target, _, features = runs
    run = Path(shutil.copytree(root / "resumed", tmp_path / "run"))
    newest = run / "checkpoints" / "step-00000004"
    weights = newest / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF  # one byte of a tensor: same size, other bytes
    weights.write_bytes(bytes(damaged))
    line = refused(train_args(target, run, "--features", str(features), max_steps="5"), run)
    assert f"checkpoint {newest} is damaged (model.safetensors: " in line and "SHA-256" in line, line
    assert "remove it to resume from step-00000002" in line, line
    shutil.rmtree(newest)
    report = train(TrainOptions(target=target, out=run, features=features, resume=True, **{**SMALL, "max_steps": 5}))
    assert (report.resumed_from, report.steps) == (2, 5)


def test_a_rerun_of_eyas_run_resumes_without_a_new_record_and_refuses_a_changed_option(runs, tmp_path):
    _, target, data, _ = runs
    workdir = tmp_path / "work"
    shutil.copytree(data, workdir / "data")
    config = tmp_path / "run.toml"
    config.write_text(f'target = "{target}"\nworkdir = "{workdir}"\nstages = ["train"]\n[train]\nmax_steps = 2\n'
                      'token_budget = 256\nttt_steps = 2\ncheckpoint_every = 2\neval_batches = 1\nlr = 1e-3\n')
    first = CliRunner().invoke(app, ["run", str(config)])
    assert first.exit_code == 0, first.output
    record, report = snapshot(workdir / "run")[Path("train_options.json")], read_json(workdir / "run" / "report.json")
    again = CliRunner().invoke(app, ["run", str(config)])
    assert again.exit_code == 0 and "trained 2 steps" in again.output, again.output
    assert snapshot(workdir / "run")[Path("train_options.json")] == record  # a finished run run again records nothing
    assert read_json(workdir / "run" / "report.json")["tokens"] == report["tokens"]
    line = refused(["run", str(config), "--set", "train.lr=0.01"], workdir / "run")
    assert "trained with --lr 0.001; this resume gives --lr 0.01" in line and "train.lr" in line, line


def commands(card: str) -> list[list[str]]:
    """The card's bash blocks as argument lists, line continuations joined as a shell joins them."""
    blocks = card.split("```bash\n")[1:]
    return [shlex.split(block.split("```")[0].replace("\\\n", " ")) for block in blocks]


def test_the_model_card_gives_the_true_totals_and_serve_commands_that_run_as_written(runs, tmp_path):
    root, target, *_ = runs
    result = CliRunner().invoke(app, ["export", str(root / "resumed"), "--out", str(tmp_path / "draft")])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "draft" / "README.md").read_text()
    report = read_json(root / "resumed" / "report.json")
    assert f"| steps / tokens | 4 / {report['tokens']} |" in card
    before = report["initial_eval"]
    assert f"(before training: {before['tau']:.2f})" in card and "pypi.org" not in card
    final = report["final_eval"]  # and the simulated τ of drawn chains at the evaluation's temperature (default 1)
    assert (f"| simulated τ sampling at T = 1 (drafts drawn from the drafter) | {final['tau_at_temperature']['1']:.2f} "
            f"(before: {before['tau_at_temperature']['1']:.2f}) |") in card
    vllm, sglang = commands(card)
    assert vllm[:2] == ["vllm", "serve"] and Path(vllm[2]).is_absolute() and (Path(vllm[2]) / "config.json").is_file()
    assert Path(vllm[2]) == Path(target).resolve()
    speculative = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert speculative["method"] == "eagle3" and speculative["num_speculative_tokens"] == 5
    assert Path(speculative["model"]) == (tmp_path / "draft").resolve() and (Path(speculative["model"]) / "config.json").is_file()
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    options = dict(zip(sglang[3::2], sglang[4::2], strict=True))
    assert options["--model-path"] == vllm[2] and options["--speculative-algorithm"] == "EAGLE3"
    assert options["--speculative-draft-model-path"] == speculative["model"]
    assert set(options) == {"--model-path", "--speculative-algorithm", "--speculative-draft-model-path",
                            "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"}
    speculators = CliRunner().invoke(app, ["export", str(root / "resumed"), "--out", str(tmp_path / "spec"), "--format",
                                           "speculators"])
    assert speculators.exit_code == 0, speculators.output
    verifier = read_json(tmp_path / "spec" / "config.json")["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == vllm[2]  # `vllm serve DRAFT_DIR` loads the verifier from there


def test_the_served_target_is_a_hub_id_an_absolute_directory_or_a_placeholder_that_says_so(runs, tmp_path, monkeypatch):
    from transformers import AutoConfig

    _, target, *_ = runs
    config = AutoConfig.from_pretrained(target)
    monkeypatch.chdir(Path(target).parent)
    relative = target_facts(Path(target).name, config, Path(target).name)  # a directory given relative to the cwd
    monkeypatch.chdir(tmp_path)
    assert serve_target(relative) == (str(Path(target).resolve()), None)
    assert serve_target({"spec": "owner/model", "source": "owner/model"}) == ("owner/model", None)
    served, note = serve_target({"spec": "demo", "source": target})  # the conversion eyas made
    assert served == str(Path(target).resolve()) and "converted" in note
    served, note = serve_target({"spec": "/models/m.gguf", "source": str(tmp_path / "gone")})
    assert served == "<HF directory converted from /models/m.gguf>" and "gone" in note and "converts it again" in note
    served, note = serve_target({"spec": "/models/hf", "source": "/models/hf"})
    assert served == "<HF directory of /models/hf>" and "gone" in note
