"""`torchrun --nproc-per-node 2 eyas train` (gloo, CPU) equals one process with doubled accumulation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import zoo
from eyas.store.capture_stage import CaptureOptions, capture


def run_train(args, nproc=None):
    command = [sys.executable, "-m", "eyas", "train", *args]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", "29614",
                   "-m", "eyas", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_two_gloo_ranks_equal_one_process_with_doubled_accumulation(tmp_path):
    target = zoo.save_tiny_target(tmp_path / "target")
    data = zoo.write_data_dir(tmp_path / "data", sizes=(("train", 32), ("holdout", 4)))
    capture(CaptureOptions(target=target, data=Path(data), out=tmp_path / "f", dtype="fp32", token_budget=200, max_batch=4))
    common = ["--target", target, "--features", str(tmp_path / "f"), "--max-steps", "4", "--token-budget", "256",
              "--ttt-steps", "3", "--lr", "1e-3", "--checkpoint-every", "2", "--eval-batches", "1"]
    run_train([*common, "--grad-accum", "2", "--out", str(tmp_path / "one")])
    run_train([*common, "--grad-accum", "1", "--out", str(tmp_path / "two")], nproc=2)
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    one, two = read(tmp_path / "one"), read(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3, 4]
    for a, b in zip(one[1:], two[1:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and a["tokens"] == b["tokens"]
    a = load_file(tmp_path / "one" / "final" / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
