"""One writer per stage directory (eyas.out_lock): a second process writing the same --out is refused in one line,
a killed holder's lock is free at once, and every stage takes the lock before it does anything."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.out_lock import lock_path, writer_lock
from eyas.outputs import OutputError

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from eyas.out_lock import writer_lock
    with writer_lock(Path(sys.argv[1]), sys.argv[2]):
        print("held", flush=True)
        time.sleep(600)
""")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path / "cache"


def hold(out: Path, stage: str = "train") -> subprocess.Popen:
    """Another process holding ``out``'s lock (until killed)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), stage], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_is_refused_and_a_killed_ones_lock_is_free(cache, tmp_path):
    out = tmp_path / "run"
    holder = hold(out)
    try:
        with pytest.raises(OutputError) as refused:
            with writer_lock(out, "train"):
                pass
        message = str(refused.value)
        assert f"--out {out} is being written by eyas train (process {holder.pid} on " in message
        assert "wait for it to finish or stop it, or choose another --out" in message
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: no cleanup runs
        holder.wait()
    assert lock_path(out).exists()  # left behind by the killed process, and free
    with writer_lock(out, "train"):
        with writer_lock(out / ".." / "run", "train"):  # re-entrant in one process, whatever the path's spelling
            pass
    assert not lock_path(out).exists()  # a released lock leaves no file


def test_a_stage_that_wrote_nothing_leaves_nothing(cache, tmp_path):
    with writer_lock(tmp_path / "out", "prepare"):
        assert lock_path(tmp_path / "out").exists()
    assert not cache.exists()  # not even the lock's directory, which it made


def test_other_directories_and_other_ranks_are_not_held_back(cache, tmp_path, monkeypatch):
    holder = hold(tmp_path / "a")
    try:
        with writer_lock(tmp_path / "b", "capture"):
            pass
        monkeypatch.setenv("RANK", "1")  # torchrun's other ranks write nothing of the directory's own
        with writer_lock(tmp_path / "a", "capture"):
            pass
    finally:
        holder.kill()
        holder.wait()


# every stage's command with just enough to reach its run function (the lock comes before anything else is checked)
STAGES = {
    "prepare": ["prepare", "--target", "demo", "--data", "sharegpt"],
    "capture": ["capture", "--target", "demo", "--data", "nowhere"],
    "train": ["train", "--target", "demo", "--features", "nowhere"],
    "export": ["export", "nowhere"],
    "bench": ["bench", "--target", "demo", "--draft", "nowhere"],
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_refuses_a_directory_another_process_writes(cache, tmp_path, stage):
    out = tmp_path / "out"
    holder = hold(out, stage)
    try:
        result = CliRunner().invoke(app, [*STAGES[stage], "--out", str(out)], terminal_width=400)
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"is being written by eyas {stage} (process {holder.pid}" in errors[0], result.output
    assert not out.exists()  # nothing written
