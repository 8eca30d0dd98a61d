"""kill -9 at the worst moments, then the same command again: the result is bit-identical to an uninterrupted run.

Each stage command runs in its own process (forked by ``kill_points.py`` after one shared import) and SIGKILLs itself
(a) mid-write — its shard or checkpoint cut to half its bytes under the temporary name — and (b) just after the
rename, before the manifest (a capture's ``manifest.rank0.json``, a run's ``checkpoints/latest.json``, the final
weights' ``manifest.json``) lists it. Then the same command (with ``--resume`` for training) finishes the job.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app

TESTS = Path(__file__).resolve().parent
SHARD = "*-[0-9][0-9][0-9][0-9][0-9].safetensors"


def capture_args(target, data, out) -> list[str]:
    # one batch per shard (--shard-mb 0): many shard writes for the kill to land in
    return ["capture", "--target", str(target), "--data", str(data), "--out", str(out), "--dtype", "fp32",
            "--token-budget", "200", "--max-batch", "4", "--shard-mb", "0"]


def train_args(target, source: list[str], out) -> list[str]:
    return ["train", "--target", str(target), *source, "--out", str(out), "--max-steps", "6", "--token-budget", "256",
            "--checkpoint-every", "2", "--lr", "1e-3", "--ttt-steps", "3", "--eval-batches", "1"]


# name → (stage, call patched, destination glob, nth matching call, when)
SCENARIOS = {
    "capture-mid-shard": ("capture", "replace", SHARD, 3, "torn"),
    "capture-shard-renamed-not-listed": ("capture", "replace", SHARD, 3, "after"),
    "train-offline-mid-checkpoint": ("offline", "rename", "step-*", 2, "torn"),
    "train-offline-checkpoint-renamed-not-latest": ("offline", "rename", "step-*", 2, "after"),
    "train-offline-final-weights-no-manifest": ("offline", "replace", "model.safetensors", 1, "after"),
    "train-online-mid-checkpoint": ("online", "rename", "step-*", 2, "torn"),
    "train-online-checkpoint-renamed-not-latest": ("online", "rename", "step-*", 2, "after"),
}


def run(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Uninterrupted runs of each command, and every scenario's killed run: name → (its command, its --out).

    Every run of this module uses one CPU thread, the killed ones (OMP_NUM_THREADS=1) and the ones in this process
    alike: a CPU reduction's result depends on how many threads share it, so a resume is bit-identical to an
    uninterrupted run on the same machine with the same thread count, not across thread counts.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _world(tmp_path_factory)
    finally:
        torch.set_num_threads(threads)


def _world(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    target = zoo.save_tiny_target(root / "target")
    data = zoo.write_data_dir(root / "data")
    features = root / "features"
    run(capture_args(target, data, features))
    sources = {"offline": ["--features", str(features)], "online": ["--data", str(data), "--online"]}
    clean = {"capture": features}
    for kind, source in sources.items():
        run(train_args(target, source, root / f"clean-{kind}"))
        clean[kind] = root / f"clean-{kind}"
    commands, scenarios = {}, []
    for name, (stage, call, match, nth, when) in SCENARIOS.items():
        out = root / name
        argv = capture_args(target, data, out) if stage == "capture" else train_args(target, sources[stage], out)
        commands[name] = (stage, argv, out)
        scenarios.append({"name": name, "argv": argv, "call": call, "match": match, "nth": nth, "when": when})
    (root / "scenarios.json").write_text(json.dumps(scenarios))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, str(TESTS / "kill_points.py"), str(root / "scenarios.json"),
                             str(root / "results.json")], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 0, killed.stdout[-2000:] + killed.stderr[-3000:]
    return clean, commands, json.loads((root / "results.json").read_text())


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    """Temporary files or directories anywhere under ``directory`` (what a killed writer leaves)."""
    return [str(p) for p in Path(directory).rglob(".*") if ".tmp-" in p.name]


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s[0] == "capture"])
def test_capture_killed_then_rerun_writes_the_same_shards(world, name):
    clean, commands, status = world
    _, argv, out = commands[name]
    assert status[name] == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    listed = {s["file"] for s in json.loads((out / "manifest.rank0.json").read_text())["shards"]}
    if SCENARIOS[name][-1] == "torn":  # a shard's bytes, cut short, under its temporary name
        assert leftovers(out)
    else:  # a shard in place that the manifest does not list
        assert {p.name for p in out.glob(SHARD)} - listed
    run(argv)  # the same command
    expected = json.loads((clean["capture"] / "manifest.json").read_text())["shards"]
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["complete"] and [s["file"] for s in resumed["shards"]] == [s["file"] for s in expected]
    for record in expected:
        assert sha(out / record["file"]) == record["sha256"], record["file"]  # byte-identical shards, each listed once
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in expected]
    assert sorted(p.name for p in out.glob(SHARD)) == sorted(s["file"] for s in expected)
    assert not leftovers(out) and not list(out.glob("manifest.rank*.json"))


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s[0] != "capture"])
def test_training_killed_then_resumed_ends_with_the_same_weights(world, name):
    clean, commands, status = world
    kind, argv, out = commands[name]
    assert status[name] == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())["checkpoint"]
    if SCENARIOS[name][-1] == "torn":  # checkpoint 4 cut short in its temporary directory; latest.json names 2
        assert leftovers(out / "checkpoints") and latest == "step-00000002"
    elif SCENARIOS[name][1] == "rename":  # checkpoint 4 in place, latest.json still naming 2
        assert (out / "checkpoints" / "step-00000004" / "state.json").is_file() and latest == "step-00000002"
    else:  # the final weights in place, no manifest yet
        assert (out / "final" / "model.safetensors").is_file() and latest == "step-00000006"
    refused = CliRunner().invoke(app, argv)  # the same command without --resume does not touch the run
    assert refused.exit_code == 2 and "--resume" in refused.output
    run([*argv, "--resume"])
    final = "final/model.safetensors"
    assert sha(out / final) == sha(clean[kind] / final)  # bit-identical weights
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(7))  # what the killed run logged after its last checkpoint is not repeated
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004", "step-00000006"]
    assert not leftovers(out)  # no temporary checkpoint of the killed run left behind
    assert json.loads((out / "manifest.json").read_text())["stage"] == "train"
