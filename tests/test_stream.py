"""eyas train --stream: a producer process captures DATA_DIR in the trainer's order and hands the states over through
a bounded shared-memory buffer. Streamed weights equal an offline run's from a store captured in the same batches; a
producer or trainer killed with -9 resumes to the same weights; a full buffer holds the producer back."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import zoo
from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.errors import EyasError
from eyas.train.checkpoint import latest_checkpoint
from eyas.train.options import TrainOptions
from eyas.train.trainer import train

BUDGET = 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and a DATA_DIR whose files list the samples in their ids' order: then a store captured with the
    training's token budget holds each sample computed in the very batch the trainer's plan puts it in."""
    root = tmp_path_factory.mktemp("stream")
    target = zoo.save_tiny_target(root / "target")
    data = Path(zoo.write_data_dir(root / "data", sizes=(("train", 40), ("holdout", 6)), id_digits=3))
    return target, data, root


def opts(target, out, **overrides):
    base = dict(target=target, out=Path(out), max_steps=6, token_budget=BUDGET, checkpoint_every=3, lr=1e-3,
                ttt_steps=3, eval_batches=2)
    return TrainOptions(**{**base, **overrides})


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_streamed_weights_equal_an_offline_run_from_a_store_of_the_same_batches(setup, tmp_path, dtype):
    target, data, _ = setup
    features = tmp_path / "features"
    capture(CaptureOptions(target=target, data=data, out=features, dtype=dtype, token_budget=BUDGET, max_batch=64))
    offline = train(opts(target, tmp_path / "offline", features=features))
    streamed = train(opts(target, tmp_path / "streamed", data=data, stream=True, stream_dtype=dtype))
    zoo.assert_same_final_weights(tmp_path / "offline", tmp_path / "streamed")
    assert [m.get("loss") for m in metrics(tmp_path / "offline")] == [m.get("loss") for m in metrics(tmp_path / "streamed")]
    assert streamed.final_eval == offline.final_eval != {}
    assert not list((tmp_path / "streamed").rglob("*.parquet")) and not (tmp_path / "streamed" / "features").exists()
    # each step's line says how long this segment has waited for its data so far (here the producer's capture)
    waits = [m["data_wait_s"] for m in metrics(tmp_path / "streamed") if "loss" in m]
    assert waits == sorted(waits) and waits[-1] > 0


def test_a_producer_thread_streams_the_same_weights_and_a_run_may_switch_producers_on_resume(setup, tmp_path):
    """--stream-producer thread: the same capture in a thread of the trainer's process (no copies between processes);
    its run equals a store's, and a run begun with a process resumes with a thread as one begun with a thread does."""
    target, data, _ = setup
    features = tmp_path / "features"
    capture(CaptureOptions(target=target, data=data, out=features, dtype="bf16", token_budget=BUDGET, max_batch=64))
    train(opts(target, tmp_path / "offline", features=features))
    threaded = train(opts(target, tmp_path / "thread", data=data, stream=True, stream_producer="thread"))
    zoo.assert_same_final_weights(tmp_path / "offline", tmp_path / "thread")
    assert threaded.final_eval != {}
    assert not [t for t in threading.enumerate() if t.name == "eyas-stream-producer"]  # it stopped with the run
    for run, first in (("threads", "thread"), ("switched", "process")):  # 3 steps, then resumed to 6 by a thread
        train(opts(target, tmp_path / run, data=data, stream=True, stream_producer=first, max_steps=3))
        resumed = train(opts(target, tmp_path / run, data=data, stream=True, stream_producer="thread", max_steps=6,
                             resume=True))
        assert resumed.resumed_from == 3
    zoo.assert_same_final_weights(tmp_path / "threads", tmp_path / "switched")


def test_a_producer_thread_that_fails_ends_the_run_in_one_line(setup, tmp_path):
    target, data, _ = setup
    with pytest.raises(EyasError, match="the stream's producer failed: .*cuda") as caught:
        train(opts(target, tmp_path / "run", data=data, stream=True, stream_producer="thread", producer_device="cuda:3"))
    assert "\n" not in str(caught.value)
    with pytest.raises(EyasError, match="--stream-producer thread runs the target with HF"):
        train(opts(target, tmp_path / "run2", data=data, stream=True, stream_producer="thread", stream_engine="vllm"))


def test_the_producer_is_a_thread_by_default_only_beside_the_training_on_its_own_gpu():
    """--stream-producer auto (the default): a thread where HF runs the target on the trainer's own GPU (there it
    streamed faster than a process, BENCHMARKS), a process elsewhere; process and thread are taken as given."""
    from types import SimpleNamespace

    from eyas.train.stream.setup import producer_in_thread

    def thread(device, producer="auto", producer_device=None, engine="hf"):
        options = SimpleNamespace(stream_producer=producer, producer_device=producer_device, stream_engine=engine)
        return producer_in_thread(options, torch.device(device))

    assert thread("cuda:0") and thread("cuda:0", producer_device="cuda:0") and thread("cuda:1", producer_device="cuda:1")
    assert not thread("cuda:0", producer_device="cuda:1")  # a GPU of its own: nothing shared
    assert not thread("cuda:0", producer_device="cuda")  # the target spread over every GPU
    assert not thread("cuda:0", engine="vllm") and not thread("cpu")
    assert not thread("cuda:0", producer="process") and thread("cpu", producer="thread")


def test_the_loader_counts_the_time_the_trainer_waits_for_a_batch():
    from eyas.train.data import Prefetcher

    class Slow:  # a source whose host side takes 0.3 s a batch
        batches = [0, 1]

        def host_batch(self, index):
            time.sleep(0.3)
            return index

        def to_device(self, host):
            return host

    loader = Prefetcher(Slow())
    loader.ahead([0, 1])
    try:
        assert loader.batch(0) == 0 and 0.2 < loader.waited < 0.6  # asked for at once: waited for it
        time.sleep(0.6)  # batch 1 loads meanwhile
        before = loader.waited
        assert loader.batch(1) == 1 and loader.waited - before < 0.1  # ready: no wait
    finally:
        loader.close()


def test_a_stream_at_fp32_is_the_online_run(setup, tmp_path):
    """The same batches, captured at full precision: what --online trains on, bit for bit."""
    target, data, _ = setup
    train(opts(target, tmp_path / "online", data=data, online=True))
    train(opts(target, tmp_path / "streamed", data=data, stream=True, stream_dtype="fp32", stream_depth=1))
    zoo.assert_same_final_weights(tmp_path / "online", tmp_path / "streamed")


def _command(target, data, out, *extra):
    return [sys.executable, "-m", "eyas", "train", "--target", target, "--data", str(data), "--stream", "--out", str(out),
            "--max-steps", "30", "--token-budget", str(BUDGET), "--checkpoint-every", "2", "--lr", "1e-3",
            "--ttt-steps", "3", "--eval-batches", "1", *extra]


def _producer_pid(process) -> int:
    """The producer's pid, from the line the trainer prints when it starts it."""
    for line in process.stdout:
        if line.startswith("stream: the producer (pid "):
            return int(line.split("(pid ")[1].split(")")[0])
    raise AssertionError(f"no producer line; the trainer exited with {process.wait()}")


def _wait_for(condition, what: str, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")), default=0) \
        if path.is_file() else 0


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # dead, not yet reaped


@pytest.fixture(scope="module")
def clean(setup):
    """The uninterrupted streamed run every killed one must end like."""
    target, data, root = setup
    train(opts(target, root / "clean", data=data, stream=True, max_steps=30, checkpoint_every=2, eval_batches=1))
    return root / "clean"


def _run_to_kill(target, data, tmp_path):
    """The clean run started as a command → (its RUN_DIR, its process, its producer's pid)."""
    run = tmp_path / "killed"
    process = subprocess.Popen(_command(target, data, run), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return run, process, _producer_pid(process)


def test_killed_producer_ends_the_run_in_one_line_after_a_checkpoint_and_resume_is_identical(setup, clean, tmp_path):
    target, data, _ = setup
    run, process, producer = _run_to_kill(target, data, tmp_path)
    _wait_for(lambda: _steps_logged(run) >= 3, "step 3")
    os.kill(producer, signal.SIGKILL)
    rest = process.stdout.read()
    assert process.wait() == 2, rest[-3000:]  # an EyasError
    line = [x for x in rest.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and f"the stream's producer (pid {producer}) was killed by signal 9" in line[0], rest[-3000:]
    assert "checkpointed at step" in line[0] and "--resume" in line[0] and "Traceback" not in rest
    stopped = int(line[0].split("checkpointed at step ")[1].split(":")[0])
    assert 3 <= stopped < 30 and (run / "checkpoints" / f"step-{stopped:08d}").is_dir()
    resumed = train(opts(target, run, data=data, stream=True, max_steps=30, checkpoint_every=2, eval_batches=1,
                         resume=True))
    assert resumed.resumed_from == stopped and resumed.steps == 30
    zoo.assert_same_final_weights(clean, run)


def test_killed_trainer_takes_its_producer_along_and_resume_is_identical(setup, clean, tmp_path):
    target, data, _ = setup
    run, process, producer = _run_to_kill(target, data, tmp_path)
    # committed: latest.json names it (a kill between the directory's rename and that pointer resumes from the one before)
    _wait_for(lambda: (latest_checkpoint(run) or Path("step-0")).name >= "step-00000004", "the step-4 checkpoint")
    process.kill()
    process.wait()
    _wait_for(lambda: _gone(producer), "the producer to die with its trainer", 10)
    resumed = train(opts(target, run, data=data, stream=True, max_steps=30, checkpoint_every=2, eval_batches=1,
                         resume=True))
    assert resumed.resumed_from >= 4 and resumed.steps == 30
    zoo.assert_same_final_weights(clean, run)


def test_a_full_buffer_holds_the_producer_back(setup, capfd):
    """Back-pressure: with nobody taking batches the producer captures --stream-depth of them and waits."""
    from eyas.train.stream.producer import ProducerSpec
    from eyas.train.stream.source import Stream

    target, data, _ = setup
    spec = ProducerSpec(target=target, device="cpu", data=str(data), layer_ids=(1, 2, 3), token_budget=64, multiple=1,
                        dtype="bf16", trust_remote_code=False, holdout=True)
    stream = Stream(spec, depth=2)
    try:
        stream.start(seed=0, epoch=0, index=0, rank=0, world=1)
        _wait_for(lambda: stream.batches.qsize() == 2, "two batches captured")
        time.sleep(1.0)
        assert stream.batches.qsize() == 2 and stream.process.is_alive()  # waiting, not capturing a third
        key, body = stream.holdout(0)
        assert key == (0, 0, 0) and body["lengths"]  # and still answering the evaluation while it waits
        stream.next_batch()
        _wait_for(lambda: stream.batches.qsize() == 2, "the taken batch replaced")
    finally:
        stream.close()
    assert not stream.process.is_alive()
    # its one line at the end says where its time went: the third batch waited over a second for room
    said = re.search(r"the producer captured (\d+) training batches \(([\d,]+) tokens\) in [\d.]+ s \([\d,]+ tokens/s\) "
                     r"and waited ([\d.]+) s for room", capfd.readouterr().err)
    assert said and int(said[1]) in (3, 4) and float(said[3]) >= 0.9


def test_a_producer_that_cannot_start_ends_the_run_in_one_line(setup, tmp_path):
    target, data, _ = setup
    with pytest.raises(EyasError, match="the stream's producer failed: .*cuda") as caught:
        train(opts(target, tmp_path / "run", data=data, stream=True, producer_device="cuda:3"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("given, said", [
    (dict(features="FEATURES"), "without --features or --online"),
    (dict(online=True), "without --features or --online"),
])
def test_stream_refuses_other_sources(setup, tmp_path, given, said):
    target, data, _ = setup
    given = {k: (tmp_path / v if v == "FEATURES" else v) for k, v in given.items()}
    with pytest.raises(EyasError, match=said):
        train(opts(target, tmp_path / "run", data=data, stream=True, **given))


def test_a_streamed_run_resumes_only_as_a_stream(setup, tmp_path):
    target, data, _ = setup
    train(opts(target, tmp_path / "run", data=data, stream=True, max_steps=3))
    with pytest.raises(EyasError, match="without --online|--stream"):
        train(opts(target, tmp_path / "run", data=data, online=True, max_steps=6, resume=True))
    with pytest.raises(EyasError, match="--stream-dtype"):
        train(opts(target, tmp_path / "run", data=data, stream=True, stream_dtype="fp32", max_steps=6, resume=True))
    torch.manual_seed(0)
    resumed = train(opts(target, tmp_path / "run", data=data, stream=True, stream_depth=1, max_steps=6, resume=True))
    assert resumed.resumed_from == 3 and resumed.steps == 6


@pytest.mark.parametrize("given, flags", [(dict(stream_depth=8), "--stream-depth configures"),
                                          (dict(stream_producer="thread"), "--stream-producer configures"),
                                          (dict(stream_listen="h:1", vllm_args=["x=1"]), "--stream-listen, --vllm-arg")])
def test_a_streams_options_without_stream_are_refused(setup, tmp_path, given, flags):
    target, data, _ = setup
    with pytest.raises(EyasError, match=f"{flags}.* add --stream, or leave"):
        opts(target, tmp_path / "run", data=data, online=True, **given)


def test_no_compile_layers_is_refused_where_no_hf_capture_reads_it(setup, tmp_path):
    target, data, _ = setup
    with pytest.raises(EyasError, match="--no-compile-layers configures .* --features FEATURES_DIR captures nothing"):
        opts(target, tmp_path / "run", features=tmp_path / "features", compile_layers=False)
    with pytest.raises(EyasError, match="--no-compile-layers configures the HF producer's capture"):
        train(opts(target, tmp_path / "run", data=data, stream=True, stream_engine="vllm", compile_layers=False))
    opts(target, tmp_path / "run", data=data, online=True, compile_layers=False)  # read by --online and --stream
    opts(target, tmp_path / "run", data=data, stream=True, compile_layers=False)
