"""`torchrun --nproc-per-node 2 eyas train` (gloo, CPU) equals one process with doubled accumulation."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import zoo


def run_train(args, nproc=None):
    command = [sys.executable, "-m", "eyas", "train", *args]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   zoo.free_port(), "-m", "eyas", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("sharding, layout", [([], []), (["--fsdp"], ["--fc-norm", "--norm-output"])],
                         ids=["replicated", "fsdp2-eagle3.1"])
def test_two_gloo_ranks_equal_one_process_with_doubled_accumulation(tmp_path, sharding, layout):
    """Data parallel over two ranks (replicated, or sharded by FSDP2, here with EAGLE-3.1's per-state norms, each its own
    unit) trains the weights one process trains with twice the accumulation."""
    target, _, features = zoo.tiny_store(tmp_path, sizes=(("train", 32), ("holdout", 4)))
    common = ["--target", target, "--features", str(features), "--max-steps", "4", "--token-budget", "256",
              "--ttt-steps", "3", "--lr", "1e-3", "--checkpoint-every", "2", "--eval-batches", "1", *layout]
    run_train([*common, "--grad-accum", "2", "--out", str(tmp_path / "one")])
    run_train([*common, *sharding, "--grad-accum", "1", "--out", str(tmp_path / "two")], nproc=2)
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    one, two = read(tmp_path / "one"), read(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3, 4]
    for a, b in zip(one[1:], two[1:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and a["tokens"] == b["tokens"]
    a = load_file(tmp_path / "one" / "final" / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert ("fc_norm.0.weight" in a) == bool(layout)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


KILL_AT_STEP_2 = """
import os, signal, sys
import eyas.train.trainer as trainer
from eyas.cli import app
real = trainer.save_checkpoint

def save_then_die(run_dir, step, *args, **kwargs):
    path = real(run_dir, step, *args, **kwargs)
    if step == 2 and kwargs.get("write", True):
        os.kill(os.getpid(), signal.SIGKILL)
    return path

trainer.save_checkpoint = save_then_die
app(sys.argv[1:])
"""


def test_fsdp2_run_killed_and_resumed_equals_uninterrupted(tmp_path):
    target, _, features = zoo.tiny_store(tmp_path, sizes=(("train", 32), ("holdout", 4)))
    common = ["train", "--target", target, "--features", str(features), "--max-steps", "4", "--token-budget", "256",
              "--ttt-steps", "2", "--lr", "1e-3", "--checkpoint-every", "2", "--eval-batches", "1", "--fsdp"]
    run_train(common[1:] + ["--out", str(tmp_path / "clean")], nproc=2)
    script = tmp_path / "kill.py"
    script.write_text(KILL_AT_STEP_2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", zoo.free_port(),
                             str(script), *common, "--out", str(tmp_path / "resumed")], capture_output=True, text=True, env=env,
                            timeout=600)
    assert killed.returncode != 0 and (tmp_path / "resumed" / "checkpoints" / "step-00000002").is_dir()
    run_train(common[1:] + ["--out", str(tmp_path / "resumed"), "--resume"], nproc=2)
    a = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2-ranks-to-1", "1-to-2-ranks"])
def test_a_run_resumes_exactly_on_another_number_of_processes(tmp_path, before, after):
    """Killed at step 2 on ``before`` processes (two gloo ranks: FSDP2), resumed on ``after``: refused while a step's
    micro-batches (--grad-accum × processes) would change, exact when --grad-accum keeps them — the same batches a
    step, the optimizer state saved whole and loaded sharded or not. Its final weights equal an uninterrupted run's."""
    target, _, features = zoo.tiny_store(tmp_path, sizes=(("train", 32), ("holdout", 4)))
    common = ["train", "--target", target, "--features", str(features), "--max-steps", "4", "--token-budget", "256",
              "--ttt-steps", "2", "--lr", "1e-3", "--checkpoint-every", "2", "--eval-batches", "1", "--fsdp"]
    accum = {1: ["--grad-accum", "2"], 2: ["--grad-accum", "1"]}  # two micro-batches a step either way
    launch = {1: [sys.executable], 2: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                       "--master-port", zoo.free_port()]}
    run_train(common[1:] + accum[before] + ["--out", str(tmp_path / "clean")], nproc=before if before > 1 else None)
    script = tmp_path / "kill.py"
    script.write_text(KILL_AT_STEP_2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([*launch[before], str(script), *common, *accum[before], "--out", str(tmp_path / "moved")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert killed.returncode != 0 and (tmp_path / "moved" / "checkpoints" / "step-00000002").is_dir()
    refused = subprocess.run([*launch[after], "-m", "eyas", *common, *accum[before], "--out", str(tmp_path / "moved"),
                              "--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert refused.returncode != 0
    assert "2 micro-batches a step" in refused.stderr and f"resume with --grad-accum {2 // after}" in refused.stderr
    run_train(common[1:] + accum[after] + ["--out", str(tmp_path / "moved"), "--resume"], nproc=after if after > 1 else None)
    a = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    b = load_file(tmp_path / "moved" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    segments = json.loads((tmp_path / "moved" / "train_options.json").read_text())["segments"]
    assert [(s["step"], s["world"]) for s in segments] == [(0, before), (2, after)]
    assert segments[1]["changed"] == {"grad_accum": {"from": 2 // before, "to": 2 // after}}
