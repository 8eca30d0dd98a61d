"""Crash-safe file writing: a reader sees the old file or the complete new one, never a torn one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_UMASK = os.umask(0o022)
os.umask(_UMASK)


def cache_dir() -> Path:
    """The eyas cache: ``$EYAS_CACHE`` or ``~/.cache/eyas`` (the GGUF targets' dequantised weights, out-dir locks,
    torch.compile's kernels)."""
    return Path(os.environ.get("EYAS_CACHE") or Path.home() / ".cache" / "eyas").expanduser()


def temp_sibling(path: Path) -> Path:
    """The hidden name an atomic write fills before renaming it to ``path``: ``.NAME.tmp-PID``."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_temp_name(name: str) -> bool:
    """True for a name :func:`temp_sibling` makes (what a killed writer leaves behind)."""
    return name.startswith(".") and ".tmp-" in name


def remove_stale_temps(directory: Path) -> None:
    """Remove the temporary files and directories that writers killed mid-write left in ``directory`` (kill -9
    skips their cleanup); call it before writing there again, from the one process that writes."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for stale in directory.iterdir():
        if is_temp_name(stale.name):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; on success fsync it and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # some writers create 0600 files; match a plain open()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_dir(path: Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success fsync every file in it and put it in ``path``'s
    place (an older ``path`` is removed first), then fsync the parent. A crash leaves the old directory or
    none, plus at most a hidden temporary one, never a half-written ``path``. ``replace=False``: a ``path``
    that another writer completed meanwhile is kept and this one dropped (for caches of identical content)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(tmp)
        if replace:
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if replace or not path.is_dir():
                raise
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
