"""A stream across hosts (here: two processes over 127.0.0.1): `eyas train --stream --stream-listen HOST:PORT` and
`eyas produce --trainer HOST:PORT` joined by gloo. The trainer's weights equal a local stream's; either side killed
with -9 ends the other in one line, and --resume with a new producer ends where an uninterrupted run ends."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import zoo
from eyas.errors import EyasError
from eyas.train.options import TrainOptions
from eyas.train.trainer import train
from test_stream import _steps_logged, _wait_for


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    target = zoo.save_tiny_target(root / "target")
    data = Path(zoo.write_data_dir(root / "data", sizes=(("train", 40), ("holdout", 6)), id_digits=3))
    return target, data, root


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def opts(target, data, out, **overrides):
    base = dict(target=target, data=data, out=Path(out), stream=True, max_steps=30, token_budget=256,
                checkpoint_every=2, lr=1e-3, ttt_steps=3, eval_batches=1)
    return TrainOptions(**{**base, **overrides})


def _producer(target, data, port, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eyas", "produce", "--trainer", f"127.0.0.1:{port}", "--target",
                             target, "--data", str(data), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_a_remote_producer_gives_the_local_streams_weights(setup, tmp_path):
    target, data, _ = setup
    train(opts(target, data, tmp_path / "local", max_steps=6))
    port = _port()
    producer = _producer(target, data, port)
    report = train(opts(target, data, tmp_path / "remote", max_steps=6, stream_listen=f"127.0.0.1:{port}"))
    output = producer.communicate(timeout=120)[0]
    assert producer.returncode == 0 and "the trainer stopped the stream" in output, output[-3000:]
    assert report.steps == 6
    zoo.assert_same_final_weights(tmp_path / "local", tmp_path / "remote")


def test_killed_remote_producer_ends_the_run_after_a_checkpoint_and_a_new_one_resumes_it(setup, tmp_path):
    target, data, _ = setup
    train(opts(target, data, tmp_path / "clean"))
    port = _port()
    run = tmp_path / "killed"
    command = [sys.executable, "-m", "eyas", "train", "--target", target, "--data", str(data), "--stream",
               "--stream-listen", f"127.0.0.1:{port}", "--out", str(run), "--max-steps", "30", "--token-budget", "256",
               "--checkpoint-every", "2", "--lr", "1e-3", "--ttt-steps", "3", "--eval-batches", "1"]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    producer = _producer(target, data, port)
    _wait_for(lambda: _steps_logged(run) >= 3, "step 3")
    producer.kill()
    rest = trainer.communicate(timeout=120)[0]
    assert trainer.returncode == 2, rest[-3000:]
    errors = [line for line in rest.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"the stream's producer at 127.0.0.1:{port} is gone" in errors[0], rest[-3000:]
    assert "checkpointed at step" in errors[0] and "Traceback" not in rest
    port = _port()
    again = _producer(target, data, port)
    resumed = train(opts(target, data, run, resume=True, stream_listen=f"127.0.0.1:{port}"))
    again.communicate(timeout=120)
    assert resumed.steps == 30 and resumed.resumed_from >= 3
    zoo.assert_same_final_weights(tmp_path / "clean", run)


def test_killed_trainer_ends_its_remote_producer_in_one_line(setup, tmp_path):
    target, data, _ = setup
    port = _port()
    run = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-m", "eyas", "train", "--target", target, "--data", str(data),
                                "--stream", "--stream-listen", f"127.0.0.1:{port}", "--out", str(run), "--max-steps",
                                "200", "--token-budget", "256", "--ttt-steps", "3", "--eval-batches", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    producer = _producer(target, data, port)
    _wait_for(lambda: _steps_logged(run) >= 2, "step 2")
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    output = producer.communicate(timeout=120)[0]
    assert producer.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"the trainer at 127.0.0.1:{port} is gone" in errors[0], output[-3000:]


def test_a_producer_with_other_data_ends_both_sides_in_one_line(setup, tmp_path):
    target, data, root = setup
    other = Path(zoo.write_data_dir(tmp_path / "other", sizes=(("train", 40), ("holdout", 6)), seed=1, id_digits=3))
    port = _port()
    producer = _producer(target, other, port)
    with pytest.raises(EyasError, match="the stream's producer failed: --data .* is not the DATA_DIR the trainer reads"):
        train(opts(target, data, tmp_path / "run", stream_listen=f"127.0.0.1:{port}"))
    output = producer.communicate(timeout=120)[0]
    assert producer.returncode == 2 and "is not the DATA_DIR the trainer reads" in output, output[-3000:]


def test_stream_listen_refuses_what_the_producer_decides(setup, tmp_path):
    target, data, _ = setup
    with pytest.raises(EyasError, match="--producer-device: with --stream-listen the producer runs on another host"):
        train(opts(target, data, tmp_path / "run", stream_listen="127.0.0.1:1", producer_device="cpu"))
    with pytest.raises(EyasError, match="give HOST:PORT"):
        train(opts(target, data, tmp_path / "run2", stream_listen="nowhere"))
