"""`torchrun --nproc-per-node 2 eyas capture` (gloo on CPU) writes the same store as one process."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

import zoo


def run_capture(args, nproc=None, env=None):
    command = [sys.executable, "-m", "eyas", "capture", *args]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", zoo.free_port(),
                   "-m", "eyas", "capture", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_two_gloo_ranks_equal_one_process(tmp_path):
    target = zoo.save_tiny_target(tmp_path / "target")
    data = zoo.write_data_dir(tmp_path / "data")
    common = ["--target", target, "--data", data, "--dtype", "fp32", "--token-budget", "200", "--max-batch", "4", "--shard-mb", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun uses one thread per rank; match it
    run_capture([*common, "--out", str(tmp_path / "one")], env=env)
    out = run_capture([*common, "--out", str(tmp_path / "two")], nproc=2, env=env)
    assert "rank 0/2" in out and "rank 1/2" in out
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert two["complete"] and [s["file"] for s in two["shards"]] == [s["file"] for s in one["shards"]]
    assert [s["sample_ids"] for s in two["shards"]] == [s["sample_ids"] for s in one["shards"]]
    assert not list((tmp_path / "two").glob("manifest.rank*"))
    # Same plan, same batches, same arithmetic: the shards are byte-identical.
    assert [s["sha256"] for s in two["shards"]] == [s["sha256"] for s in one["shards"]]
    first = one["shards"][0]["file"]
    a, b = load_file(tmp_path / "one" / first), load_file(tmp_path / "two" / first)
    assert all(torch.equal(a[name], b[name]) for name in a)
