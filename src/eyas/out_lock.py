"""One writer per stage directory: a second eyas process writing the same ``--out`` is refused in one line.

Every stage (prepare, capture, train, export, bench) runs under :func:`one_writer`: before anything else, the process
takes an exclusive ``flock`` on a lock file for its output directory, and holds it until the stage returns or fails.
Another process asking for the same directory meanwhile — two ``eyas train`` into one ``--out`` — is refused with
what holds it (stage, process id, host, since when). The kernel releases a ``flock`` when its process dies, kill -9
included, so a lock left by a killed run is simply free for the next one: no stale lock to judge or remove.

The lock files live in the eyas cache (``$EYAS_CACHE/locks``, one per output directory, named by the hash of its
absolute path), not beside the output: a stage that replaces its directory whole (export) or has not created it yet
still has one place to lock, and nothing is added to the user's directories. Processes on other hosts writing the same
shared directory do not see each other's locks (each host has its own cache); under torchrun only the lead process
(RANK 0) writes, so only it locks. Within one process the lock is re-entrant (a stage that calls another on the same
directory keeps it).
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from eyas.outputs import OutputError, no_empty_leftover

_held: set[str] = set()  # the absolute output paths whose locks this process holds


def lock_path(out: Path) -> Path:
    """The lock file of output directory ``out`` (which need not exist yet)."""
    return _lock_file(_key(out))


def _lock_file(key: str) -> Path:
    from eyas.io import cache_dir

    return cache_dir() / "locks" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.lock"


@contextmanager
def writer_lock(out: Path, stage: str, option: str = "--out") -> Iterator[None]:
    """Hold the lock of ``out`` for ``stage`` while the block runs; refuse (:class:`OutputError`) when another process
    holds it. A process under torchrun other than RANK 0 does not lock (it does not write the directory's files)."""
    if not _leads():
        yield
        return
    key = _key(out)
    if key in _held:  # this process holds it already: the outermost holder releases it
        yield
        return
    path = _lock_file(key)
    made = _make_directories(path.parent)
    try:
        fd = _acquire(path, out, option)
    except BaseException:
        _remove_empty(made)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"stage": stage, "pid": os.getpid(), "host": socket.gethostname(), "out": key,
                                  "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode(), 0)
        _held.add(key)
        yield
    finally:
        _held.discard(key)
        try:  # removed while still locked, so whoever opens the name next finds a new file (see _acquire)
            path.unlink()
        except FileNotFoundError:
            pass
        os.close(fd)
        _remove_empty(made)  # a stage that wrote nothing leaves nothing, not even the lock's directory


def one_writer(stage: str, out_of: Callable[..., Path | str | None]):
    """Decorate a stage's run function so that it runs under :func:`writer_lock` of the output directory
    ``out_of(*args, **kwargs)`` gives (None: the stage writes nothing, no lock), and, failing, leaves no empty directory
    there (:func:`eyas.outputs.no_empty_leftover`: the lock's holder tidies, while it still holds it)."""
    def decorate(run):
        @functools.wraps(run)
        def locked(*args, **kwargs):
            out = out_of(*args, **kwargs)
            if out is None:
                return run(*args, **kwargs)
            with writer_lock(Path(out), stage), no_empty_leftover(Path(out)) if _leads() else nullcontext():
                return run(*args, **kwargs)
        return locked
    return decorate


def _leads() -> bool:
    """Whether this process writes the output directory: not a torchrun process other than RANK 0."""
    return os.environ.get("RANK", "0") == "0"


def _key(out: Path) -> str:
    return str(Path(os.path.abspath(out)).resolve())


def _make_directories(directory: Path) -> list[Path]:
    """``directory`` and its missing parents, made → the ones made now, outermost first."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()][::-1]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(directories: list[Path]) -> None:
    """Remove what :func:`_make_directories` made, innermost first, while empty (another process's lock keeps them)."""
    for directory in reversed(directories):
        try:
            directory.rmdir()
        except OSError:
            return


def _acquire(path: Path, out: Path, option: str) -> int:
    """Open ``path`` and lock it without waiting → the descriptor. A holder that released the lock removes the file
    first: when the name no longer leads to the file just locked, lock the new one instead."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # another process removed the empty directory just now
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputError(f"{option} {out} is being written by {holder}: wait for it to finish or stop it, or "
                              f"choose another {option}") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says (a holder that has not written it yet: another eyas process)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"eyas {record['stage']} (process {record['pid']} on {record['host']}, since {record['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another eyas process"
