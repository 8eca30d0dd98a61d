"""vLLM capture without vLLM: the requests file, reading the worker's output, the final norm, the
worker's resume bookkeeping and how the vLLM Python is found. A fake "vLLM Python" runs a fake
worker that writes precomputed HF states in the real worker's format (with its own helpers)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from eyas.capture import vllm_client
from eyas.capture.vllm_client import (
    IndexReader,
    capture_with_vllm,
    check_vllm_python,
    load_final_norm,
    resolve_vllm_python,
    worker_layer_ids,
    write_requests,
)
from eyas.errors import EyasError
from eyas.target import capture_hidden_states, discover_layout

AUX_IDS = (2, 4, 5)
TAPPED = (2, 4, 5, zoo.LAYERS)  # what the worker is asked for: the aux ids, then N


def _worker_module():
    """The real worker script, imported by path (its helpers import no vLLM)."""
    spec = importlib.util.spec_from_file_location("vllm_worker_under_test", vllm_client.WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama saved to disk, its final norm weight made non-trivial (ones would hide a miss)."""
    model = zoo.llama()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(0)
    return [(f"s/{i}", rng.integers(1, zoo.VOCAB, size=n).astype(np.int32)) for i, n in enumerate((5, 17, 9))]


def _reference(model, samples) -> dict[str, torch.Tensor]:
    """HF states per sample in the worker's layout: [T, len(TAPPED), H]."""
    layout = discover_layout(model)
    out = {}
    for sample_id, ids in samples:
        states = capture_hidden_states(model, layout, torch.from_numpy(ids.astype(np.int64))[None], layer_ids=TAPPED)
        out[sample_id] = states.aux[0].view(len(ids), len(TAPPED), zoo.HIDDEN).contiguous()
    return out


_FAKE_WORKER = """
import importlib.util, json, os, sys, time
from pathlib import Path

if sys.argv[1] == "-c":
    sys.exit(0)  # the engine's "can it import vllm?" probe
spec = importlib.util.spec_from_file_location("worker", sys.argv[1])
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
args = worker.parse_args(sys.argv[2:])
mode = os.environ.get("FAKE_MODE", "ok")
Path(os.environ["FAKE_PID_FILE"]).write_text(str(os.getpid()))
print("fake worker starting", file=sys.stderr, flush=True)
if mode == "fail":
    print("boom: the engine died", file=sys.stderr, flush=True)
    sys.exit(7)
import torch
from safetensors.torch import load_file

assert worker.parse_layer_ids(args.layer_ids) == [int(i) for i in os.environ["FAKE_EXPECT_IDS"].split(",")]
reference = load_file(os.environ["FAKE_REFERENCE"])
args.out.mkdir(parents=True, exist_ok=True)
with open(args.out / "index.jsonl", "a") as index:
    for n, (sample_id, ids) in enumerate(worker.read_requests(args.requests)):
        tokens = torch.tensor(ids, dtype=torch.long)
        if mode == "wrong_tokens":
            tokens = tokens.flip(0)
        name = worker.save_request(args.out, sample_id, reference[sample_id], tokens)
        index.write(json.dumps({"id": sample_id, "file": name, "tokens": len(ids)}) + "\\n")
        index.flush()
        if mode == "hang" and n == 0:
            time.sleep(120)
"""


@pytest.fixture
def fake_vllm(tmp_path, target, samples, monkeypatch):
    """A fake vLLM Python: an executable that runs the fake worker with this interpreter."""
    model, _ = target
    reference = tmp_path / "reference.safetensors"
    save_file(_reference(model, samples), str(reference))
    script = tmp_path / "fake_worker.py"
    script.write_text(textwrap.dedent(_FAKE_WORKER))
    python = tmp_path / "fake-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_REFERENCE", str(reference))
    monkeypatch.setenv("FAKE_PID_FILE", str(tmp_path / "worker.pid"))
    monkeypatch.setenv("FAKE_EXPECT_IDS", ",".join(map(str, TAPPED)))
    return str(python)


def test_capture_yields_hf_states_from_worker_output(target, samples, fake_vllm, tmp_path):
    model, directory = target
    layout = discover_layout(model)
    got = list(capture_with_vllm(iter(samples), str(directory), AUX_IDS, zoo.LAYERS, fake_vllm, tmp_path / "work"))
    assert [g[0] for g in got] == [s for s, _ in samples]
    for (_, ids), (_, aux, final) in zip(samples, got, strict=True):
        want = capture_hidden_states(model, layout, torch.from_numpy(ids.astype(np.int64))[None], layer_ids=AUX_IDS)
        assert aux.shape == (len(ids), len(AUX_IDS) * zoo.HIDDEN)
        assert torch.equal(aux, want.aux[0])
        torch.testing.assert_close(final, want.final[0], rtol=1e-6, atol=1e-6)


def test_requests_file_is_one_json_line_per_sample(tmp_path, samples):
    path = tmp_path / "requests.jsonl"
    written = write_requests(iter(samples), path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["id"] for line in lines] == [s for s, _ in samples] == [s for s, _ in written]
    assert all(line["input_ids"] == ids.tolist() and all(type(t) is int for t in line["input_ids"])
               for line, (_, ids) in zip(lines, samples, strict=True))  # fmt: skip
    assert write_requests([("x", np.array([3, 4], dtype=np.int64))], path)[0][1].tolist() == [3, 4]


@pytest.mark.parametrize(
    "bad, message",
    [
        ([("a", np.array([1])), ("a", np.array([2]))], "appears twice"),
        ([("a", np.array([], dtype=np.int32))], "non-empty"),
        ([("a", np.array([1.5]))], "integer"),
    ],
)
def test_requests_file_refuses_bad_samples(tmp_path, bad, message):
    with pytest.raises(EyasError, match=message):
        write_requests(bad, tmp_path / "requests.jsonl")


def test_worker_failure_raises_with_log_tail(target, samples, fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "fail")
    with pytest.raises(EyasError, match=r"(?s)status 7.*boom: the engine died"):
        list(capture_with_vllm(samples, str(target[1]), AUX_IDS, zoo.LAYERS, fake_vllm, tmp_path / "work"))


def test_states_for_other_tokens_are_refused(target, samples, fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "wrong_tokens")
    with pytest.raises(EyasError, match="other tokens"):
        list(capture_with_vllm(samples, str(target[1]), AUX_IDS, zoo.LAYERS, fake_vllm, tmp_path / "work"))


def test_stopping_early_ends_the_worker(target, samples, fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    stream = capture_with_vllm(samples, str(target[1]), AUX_IDS, zoo.LAYERS, fake_vllm, tmp_path / "work")
    assert next(stream)[0] == samples[0][0]
    stream.close()
    pid = int((tmp_path / "worker.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_final_norm_loads_alone_and_equals_hf(target, tmp_path, shard):
    model, directory = target
    if shard:  # a sharded checkpoint: the norm is found through model.safetensors.index.json
        directory = tmp_path / "sharded"
        model.save_pretrained(directory, max_shard_size=shard)
        assert (directory / "model.safetensors.index.json").exists()
    norm = load_final_norm(str(directory), num_layers=zoo.LAYERS)
    x = torch.randn(7, zoo.HIDDEN) * 3
    with torch.no_grad():
        assert torch.equal(norm(x), model.model.norm(x))


def test_final_norm_checks_the_layer_count(target):
    with pytest.raises(EyasError, match="decoder layers"):
        load_final_norm(str(target[1]), num_layers=zoo.LAYERS + 1)


def test_worker_ids_always_end_with_n():
    assert worker_layer_ids((2, 4, 5), 8) == (2, 4, 5, 8)
    assert worker_layer_ids((2, 4, 8), 8) == (2, 4, 8)
    with pytest.raises(ValueError):
        worker_layer_ids((5, 2), 8)


def test_index_reader_waits_for_complete_lines(tmp_path):
    path = tmp_path / "index.jsonl"
    reader = IndexReader(path)
    assert reader.poll() == {}
    path.write_text('{"id": "a", "file": "a.safetensors", "tokens": 3}\n{"id": "b", "fi')
    assert set(reader.poll()) == {"a"}
    with open(path, "a") as f:
        f.write('le": "b.safetensors", "tokens": 4}\n')
    assert set(reader.poll()) == {"a", "b"}


def test_worker_resume_skips_listed_ids_with_files(tmp_path):
    worker = _worker_module()
    out = tmp_path
    name = worker.save_request(out, "done", torch.zeros(2, 1, 4), torch.tensor([1, 2]))
    assert load_file(str(out / name))["token_ids"].tolist() == [1, 2]
    (out / "index.jsonl").write_text(
        json.dumps({"id": "done", "file": name, "tokens": 2}) + "\n"
        + json.dumps({"id": "file-gone", "file": "gone.safetensors", "tokens": 2}) + "\n"
        + '{"id": "torn'
    )
    assert worker.finished_ids(out) == {"done"}


def test_worker_file_names_are_safe_and_distinct():
    worker = _worker_module()
    names = {worker.safe_name(i) for i in ("a/b", "a_b", "a b", "../../etc", "")}
    assert len(names) == 5
    assert all("/" not in n and not n.startswith(".") and n.endswith(".safetensors") for n in names)


def test_worker_refuses_a_resume_with_other_settings(tmp_path):
    worker = _worker_module()
    meta = {"model": "m", "layer_ids": [2, 4, 8], "engine": {"dtype": "float32", "tensor_parallel_size": 1}}
    worker.check_meta(tmp_path, meta)
    worker.check_meta(tmp_path, dict(meta))  # same settings: resuming is fine
    with pytest.raises(SystemExit, match="captured with"):
        worker.check_meta(tmp_path, {**meta, "layer_ids": [1, 4, 8]})
    with pytest.raises(SystemExit, match="captured with"):
        worker.check_meta(tmp_path, {**meta, "engine": {"dtype": "bfloat16", "tensor_parallel_size": 1}})


def test_vllm_python_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    with pytest.raises(EyasError, match="EYAS_VLLM_PYTHON"):
        resolve_vllm_python()
    assert resolve_vllm_python("/explicit/python") == "/explicit/python"
    monkeypatch.setenv("EYAS_VLLM_PYTHON", "/from/env/python")
    assert resolve_vllm_python() == "/from/env/python"
    assert resolve_vllm_python("/explicit/python") == "/explicit/python"


def test_capture_refuses_a_python_without_vllm(tmp_path, samples, target):
    with pytest.raises(EyasError, match="cannot run"):
        check_vllm_python(str(tmp_path / "missing-python"))
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this environment has vllm")
    with pytest.raises(EyasError, match="cannot import vllm"):
        next(capture_with_vllm(samples, str(target[1]), AUX_IDS, zoo.LAYERS, sys.executable, tmp_path / "work"))
