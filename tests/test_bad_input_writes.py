"""Writes that would lose or clobber data: every stage checks its --out first and fails in one line, writing nothing.

Each case runs the real command and asserts the exit status (2), the one line naming the path, and that nothing was
written or lost. Tests run as root, where chmod does not stop a write: a read-only filesystem is simulated by making
``os.open`` refuse (EROFS) to create any file under one directory, as the kernel does on a read-only mount.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from test_manifests import bench_args, stages, target  # noqa: F401 — fixtures: every stage's directory, once

STAGES = ("prepare", "capture", "train", "export", "bench")


@pytest.fixture(scope="module")
def dirs(stages):  # noqa: F811 — the fixture imported above
    """Stage name → the directory it wrote (DATA_DIR, FEATURES_DIR, RUN_DIR, DRAFT_DIR, REPORT_DIR)."""
    return stages


def command(stage: str, dirs: dict[str, Path], out: Path) -> list[str]:
    """The stage's command on the fixture's inputs, writing ``out``."""
    spec = str(json.loads((dirs["bench"] / "manifest.json").read_text())["options"]["target"])
    chats = json.loads((dirs["prepare"] / "manifest.json").read_text())["sources"][0]
    return {
        "prepare": ["prepare", "--target", spec, "--data", chats, "--out", str(out), "--max-length", "64", "--holdout",
                    "0.2", "--draft-vocab-size", "300"],
        "capture": ["capture", "--target", spec, "--data", str(dirs["prepare"]), "--out", str(out), "--dtype", "fp32",
                    "--token-budget", "256", "--max-batch", "4", "--shard-mb", "0"],
        "train": ["train", "--target", spec, "--features", str(dirs["capture"]), "--out", str(out), "--max-steps", "2",
                  "--token-budget", "256", "--ttt-steps", "2", "--checkpoint-every", "2", "--eval-batches", "1"],
        "export": ["export", str(dirs["train"]), "--out", str(out), "--dtype", "fp32"],
        "bench": bench_args(spec, dirs["export"], dirs["prepare"], out),
    }[stage]


def invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def refused(result, path: Path, alone: bool = True) -> str:
    """The refusal's one line: exit status 2, one line starting 'error:' and naming ``path``; ``alone``: the only output
    (else progress lines of the work done before may precede it)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and (len(lines) == 1 or not alone), result.output
    return errors[0]


def tree(directory: Path) -> dict[str, str]:
    """Every file and folder under ``directory`` with its content's SHA-256: equal before and after = nothing written or lost."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(Path(directory).rglob("*"))}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["a file", "under a file", "read-only"])
def test_every_stage_checks_its_out_before_any_work(dirs, stage, kind, tmp_path, monkeypatch):
    import eyas.engine.loading
    import eyas.target.loading

    place = tmp_path / "place"
    place.mkdir()
    (place / "notes.txt").write_text("keep me")
    out = {"a file": place / "notes.txt", "under a file": place / "notes.txt" / "out", "read-only": place / "out"}[kind]
    if kind == "read-only":
        real_open = os.open

        def read_only_open(path, flags, *args, **kwargs):
            if str(path).startswith(str(place)) and flags & os.O_CREAT:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only_open)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --out was checked")

    for module, name in ((eyas.target.loading, "load_target"), (eyas.engine.loading, "load_target_for")):
        monkeypatch.setattr(module, name, no_target)  # bench: nothing runs before REPORT_DIR is checked
    before = tree(place)
    line = refused(invoke(command(stage, dirs, out)), out)
    assert {"a file": "is a file", "under a file": "lies under", "read-only": "Read-only file system"}[kind] in line
    assert tree(place) == before and sorted(os.listdir(tmp_path)) == ["place"]


def test_prepare_keeps_a_data_dir_prepared_with_other_options_unless_forced(dirs, tmp_path):
    data = shutil.copytree(dirs["prepare"], tmp_path / "data")
    before = tree(data)
    args = command("prepare", dirs, data)
    args[args.index("--max-length") + 1] = "48"
    line = refused(invoke(args), data)
    assert "other inputs or settings (changed: options.max_length)" in line and "--force" in line
    assert tree(data) == before  # the DATA_DIR a feature store was made from is intact
    assert invoke([*args, "--force"]).exit_code == 0
    assert json.loads((data / "manifest.json").read_text())["options"]["max_length"] == 48


@pytest.mark.parametrize("stage, holder", [("prepare", None), ("capture", "prepare"), ("train", "capture"),
                                           ("export", "train"), ("export", None), ("bench", "export")])
def test_a_directory_holding_other_data_is_kept_unless_forced(dirs, tmp_path, stage, holder):
    """Other data: files eyas did not write (a drafter from elsewhere), or another stage's directory."""
    if holder is None:
        out = tmp_path / "mine"
        (out / "old-drafter").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "old-drafter" / "model.safetensors").write_bytes(b"weights")
    else:
        out = shutil.copytree(dirs[holder], tmp_path / "mine")
    before = tree(out)
    line = refused(invoke(command(stage, dirs, out)), out)
    assert "already holds" in line and ("other data" if holder is None else f"of eyas {holder}") in line
    assert "--force" in line and tree(out) == before
    if (stage, holder) == ("export", None):  # forced, the directory becomes the DRAFT_DIR (it was replaced whole)
        assert invoke([*command(stage, dirs, out), "--force"]).exit_code == 0
        assert json.loads((out / "manifest.json").read_text())["stage"] == "export" and not (out / "old-drafter").exists()


def test_export_and_bench_keep_the_output_of_other_inputs(dirs, tmp_path):
    draft, report = shutil.copytree(dirs["export"], tmp_path / "draft"), shutil.copytree(dirs["bench"], tmp_path / "report")
    other_run = shutil.copytree(dirs["train"], tmp_path / "other-run")
    args = command("export", dirs, draft)
    args[1] = str(other_run)
    before = tree(draft)
    assert "changed: run" in refused(invoke(args), draft) and tree(draft) == before
    args = command("bench", dirs, report)
    args[args.index("--draft") + 1] = str(draft)  # the same drafter's files, but another DRAFT_DIR
    before = tree(report)
    assert "changed: draft" in refused(invoke(args), report) and tree(report) == before


def test_train_on_an_existing_run_needs_resume_or_force(dirs, tmp_path):
    run = shutil.copytree(dirs["train"], tmp_path / "run")
    before = tree(run)
    line = refused(invoke(command("train", dirs, run)), run)
    assert "--resume" in line and "--force to start it over" in line and tree(run) == before
    assert invoke([*command("train", dirs, run), "--force"]).exit_code == 0  # started over: the same run again
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert (run / "final" / "model.safetensors").read_bytes() == (dirs["train"] / "final" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("stage", STAGES)
def test_too_little_free_space_is_refused_before_writing(dirs, stage, tmp_path, monkeypatch):
    import eyas.outputs

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(eyas.outputs.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "out"
    # prepare counts the tokens and train verifies the shards before they know what they will write: progress lines first
    line = refused(invoke(command(stage, dirs, out)), out, alone=stage not in ("prepare", "train"))
    assert "not enough disk" in line and "1000 B are free" in line and "needs about" in line
    assert not out.exists()


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_no_temporary_directory(dirs, tmp_path, monkeypatch):
    import eyas.train.checkpoint

    run = tmp_path / "run"
    args = [*command("train", dirs, run), "--max-steps", "4"]  # checkpoints at steps 2 and 4
    real_save, kept = eyas.train.checkpoint.save_file, {}

    def save_until_the_disk_is_full(tensors, path, *rest, **kwargs):
        if "step-00000004" in path and path.endswith("optimizer.safetensors"):
            kept.update({name: digest for name, digest in tree(run / "checkpoints").items() if ".tmp-" not in name})
            real_save(tensors, path, *rest, **kwargs)
            os.truncate(path, os.path.getsize(path) // 2)  # the disk filled up halfway through
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(tensors, path, *rest, **kwargs)

    monkeypatch.setattr(eyas.train.checkpoint, "save_file", save_until_the_disk_is_full)
    line = refused(invoke(args), run / "checkpoints" / "step-00000004", alone=False)  # after the steps' progress
    assert "No space left on device" in line
    assert "(step-00000002) is intact" in line and "--resume" in line
    assert tree(run / "checkpoints") == kept  # step 2 and latest.json as they were; no temporary directory
    assert sorted(os.listdir(run / "checkpoints")) == ["latest.json", "step-00000002"]
    monkeypatch.undo()
    assert invoke([*args, "--resume"]).exit_code == 0  # after freeing space, the run continues from step 2
    assert json.loads((run / "report.json").read_text())["resumed_from"] == 2


@pytest.mark.parametrize("how, code", [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_bench_interrupted_near_its_end_writes_a_partial_report(dirs, tmp_path, monkeypatch, how, code):
    import os
    import signal

    import eyas.bench.run

    out = tmp_path / "report"
    args = command("bench", dirs, out)
    args[args.index("--prompts") + 1] = "3"
    calls, real = [], eyas.bench.run.generate

    def interrupted(*a, **k):  # two calls a prompt (the warm-up decodes apart, in eyas.engine.decode): stopped at the last prompt's second
        calls.append(1)
        if len(calls) == 2 * 2 + 2:
            if how == "Ctrl-C":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's time limit: the handler raises in this thread
        return real(*a, **k)

    monkeypatch.setattr(eyas.bench.run, "generate", interrupted)
    result = invoke(args)
    assert result.exit_code == code, result.output
    assert f"interrupted ({how}) after 2 of 3 prompts: wrote the partial report" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] == f"interrupted ({how}) after 2 of 3 prompts"
    assert [row["prompts"] for row in report["rows"]] == [2] and report["datasets"]["sharegpt-holdout"][0]["prompts"] == 2
    assert "Partial report" in (out / "report.md").read_text() and (out / "acceptance.png").is_file()
    assert not (out / "manifest.json").exists()  # not a finished REPORT_DIR: the same command measures every prompt
