"""What every stage checks of its output directory before it works, and how a write that fails is reported.

Every stage walks its ``--out`` through one lifecycle, :class:`StageOut`, in this order: the writer lock
(:mod:`eyas.out_lock`: the stage function's ``@one_writer``), the claim, the comparison with an earlier output's inputs,
the free space, the writes, and the manifest last. The rules of each step are the functions below.

Prepare, capture, train, export and bench each claim (:func:`claim_out`) their ``--out`` before any work. It refuses,
in one line naming the path, an ``--out`` that is a file or lies under one, one that cannot be written (a read-only
filesystem, no permission: probed by creating and removing a file), and — unless ``--force`` — a directory holding
other data: anything but this stage's own output (its ``manifest.json``, or while unfinished the files it writes).
What a stage does with its own output stays the stage's (skip it, resume it, redo it), except one rule, also here:
output made from other inputs or settings is replaced only with ``--force`` (:func:`refuse_other_inputs`).
:func:`check_space` compares the stage's estimate of what it will write with the free space, and :func:`writing`
turns an OSError while writing (a full disk) into one line saying what is intact and what to do. A stage that fails
leaves no empty directory it made or emptied (:func:`no_empty_leftover`, applied with the writer lock).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eyas.errors import EyasError
from eyas.io import is_temp_name, temp_sibling
from eyas.manifest import DIRECTORIES, FORMATS, MANIFEST

_MARGIN = 0.98  # a filesystem filled to the last byte fails in odd places: keep 2% of the free space


class OutputError(EyasError):
    """An output directory that cannot or may not be written: a file, read-only, another's data, a full disk."""


class StageOut:
    """A stage's ``--out`` through the lifecycle every stage shares (module docstring): made by :meth:`claim`; then
    :meth:`keep_inputs` (or :meth:`keep_input_places`), :meth:`need`, :meth:`writing`; ``previous``: the manifest of
    this stage the directory held when claimed (None: empty, or an unfinished run's files)."""

    def __init__(self, stage: str, out: Path, force: bool, previous: dict | None):
        self.stage, self.out, self.force, self.previous = stage, Path(out), force, previous

    @classmethod
    def claim(cls, stage: str, out: Path, force: bool, markers: Iterable[str] = ()) -> StageOut:
        """Check ``out`` before ``stage`` writes there (:func:`claim_out`; ``markers``: what the stage writes before its
        manifest)."""
        return cls(stage, out, force, claim_out(Path(out), stage, force, markers))

    def keep_inputs(self, old: dict, new: dict) -> None:
        """An earlier output identified by ``old`` is replaced by one identified by ``new`` only with --force
        (:func:`refuse_other_inputs`)."""
        refuse_other_inputs(self.out, self.stage, old, new, self.force)

    def keep_input_places(self, inputs: list[dict]) -> None:
        """:meth:`keep_inputs` by where the inputs are: the earlier manifest's input records against ``inputs``."""
        if self.previous is not None:
            self.keep_inputs(input_places(self.previous.get("inputs", [])), input_places(inputs))

    def need(self, needed: int, what: str, hint: str = "") -> int:
        """Free bytes at ``out``; refused (unless --force) when ``what`` needs more (:func:`check_space`)."""
        return check_space(self.out, needed, self.force, what, hint)

    def writing(self, advice: str, path: Path | None = None):
        """A write of ``path`` (default: the directory) that fails says so in one line with ``advice``
        (:func:`writing`)."""
        return writing(self.out if path is None else path, advice)


def claim_out(out: Path, stage: str, force: bool, markers: Iterable[str] = (), option: str = "--out") -> dict | None:
    """Check ``out`` before ``stage`` writes there; return the manifest of this stage it holds, if any.

    Refused: a file, a path under a file, a place that cannot be written, and (unless ``force``) a directory holding
    other data — anything but this stage's manifest.json or, with none, files matching ``markers`` (what the stage
    writes before its manifest: an unfinished run it resumes or redoes).
    """
    out = Path(out)
    name = DIRECTORIES[stage]
    if out.exists() and not out.is_dir():
        raise OutputError(f"{option} {out} is a file, not a directory: give a new or empty directory for the {name}")
    existing = _nearest_existing(out)
    if not existing.is_dir():
        raise OutputError(f"{option} {out} lies under {existing}, which is a file: give a directory path for the {name}")
    _probe(existing, out, option)
    entries = sorted(p.name for p in out.iterdir() if not is_temp_name(p.name)) if out.is_dir() else []
    if not entries:
        return None
    manifest = _read_manifest(out)
    if manifest and (manifest.get("stage") == stage or manifest.get("format") == FORMATS[stage]):
        return manifest
    if manifest is None and any(fnmatch.fnmatch(entry, pattern) for entry in entries for pattern in markers):
        return None
    if force:
        return None
    other = manifest.get("stage") if manifest else None
    whose = f"the {DIRECTORIES[other]} of eyas {other}" if other in DIRECTORIES else "other data"
    raise OutputError(f"{option} {out} already holds {whose} ({_listing(entries)}), not a {name} of eyas {stage}: "
                      "choose a new or empty directory, or pass --force to write over it")


def refuse_other_inputs(out: Path, stage: str, old: dict, new: dict, force: bool, option: str = "--out") -> None:
    """Refuse, unless ``force``, to replace ``stage``'s output in ``out`` made from other inputs or settings: ``old``
    and ``new`` are what identifies the output (nested dicts compare key by key)."""
    before, after = _flat(old), _flat(new)
    changed = [key for key, value in after.items() if before.get(key) != value] + [key for key in before if key not in after]
    if changed and not force:
        raise OutputError(f"{option} {out} holds a {DIRECTORIES[stage]} made from other inputs or settings (changed: "
                          f"{', '.join(changed)}); use another {option}, or pass --force to replace it")


def input_places(inputs: list[dict]) -> dict[str, str]:
    """Role → where the input is (a local path resolved, anything else as given): what export and bench outputs are
    made from, to compare with :func:`refuse_other_inputs`."""
    return {record["role"]: str(Path(record["path"]).resolve()) if Path(record["path"]).exists() else str(record["path"])
            for record in inputs}


def check_space(out: Path, needed: int, force: bool, what: str, hint: str = "") -> int:
    """Free bytes where ``out`` is (or will be); unless ``force``, refuse when ``what`` needs more: about ``needed``."""
    free = shutil.disk_usage(_nearest_existing(Path(out))).free
    if needed > free * _MARGIN and not force:
        raise OutputError(f"not enough disk at {out}: {what} needs about {human_bytes(needed)} and {human_bytes(free)} "
                          f"are free; free space{hint}, or pass --force to try anyway")
    return free


@contextmanager
def writing(path: Path, advice: str) -> Iterator[None]:
    """Turn an OSError while writing ``path`` (a full disk, a read-only remount, a vanished mount) into one line: what
    could not be written, why, and ``advice`` (what is intact, what to do)."""
    try:
        yield
    except OSError as err:
        raise OutputError(f"could not write {path}: {_reason(err)}; {advice}") from err


@contextmanager
def no_empty_leftover(out: Path) -> Iterator[None]:
    """A stage that fails leaves no empty directory at ``out``: not one it made (nor the parents it made for it), nor
    one it emptied (what ``--force`` removed before the new output could be written). Only folders that hold no file
    at all are removed: an empty directory the user made stays (without the empty folders the stage made in it), and
    anything holding a file stays whole (the finished shards or checkpoints a rerun resumes from)."""
    out = Path(os.path.abspath(out))
    made = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
    empty = not made and _holds_no_file(out)  # the user's empty directory: left as it was, its own folders too
    kept = {Path(root) / folder for root, folders, _ in os.walk(out) for folder in folders} if empty else set()
    try:
        yield
    except BaseException:
        if out.exists() and _holds_no_file(out):
            _remove_empty_tree(out, None if empty else made[1:], kept)
        raise


def available_ram() -> int | None:
    """RAM that can be allocated without swapping: psutil's "available" (Linux: MemAvailable, page cache included;
    psutil comes with accelerate), else the free pages, else None."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(count: float) -> str:
    """``1536`` → ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (as a file or a directory)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _holds_no_file(directory: Path) -> bool:
    """Whether ``directory`` is a real directory (no link) with nothing in it but folders, themselves empty so."""
    if directory.is_symlink() or not directory.is_dir():
        return False
    try:
        for root, folders, files in os.walk(directory, onerror=_raise):
            if files or any(os.path.islink(os.path.join(root, folder)) for folder in folders):
                return False
    except OSError:
        return False
    return True


def _raise(error: OSError) -> None:
    raise error


def _remove_empty_tree(out: Path, parents: list[Path] | None, kept: set[Path]) -> None:
    """Remove the folders in ``out``, a tree of empty ones, but ``kept``; then (unless ``parents`` is None: keep
    ``out``) ``out`` and each of ``parents``, innermost first, while empty. What cannot be removed stays: a failure
    here must not hide the stage's own."""
    for root, folders, _ in os.walk(out, topdown=False):
        for folder in folders:
            if Path(root) / folder not in kept:
                _rmdir(Path(root) / folder)
    for directory in (out, *parents) if parents is not None else ():
        if not _rmdir(directory):
            return


def _rmdir(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:
        return False
    return True


def _probe(directory: Path, out: Path, option: str) -> None:
    """Create and remove a file in ``directory``: permissions and read-only mounts are what the kernel says they are."""
    probe = temp_sibling(directory / "eyas-write-probe")  # a name atomic writers' cleanup also recognises
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as err:
        raise OutputError(f"{option} {out} cannot be written ({_reason(err)} in {directory}): choose a directory on a "
                          "writable filesystem") from None
    os.unlink(probe)


def _read_manifest(directory: Path) -> dict | None:
    """``directory/manifest.json`` as a dict; None when there is none, {} when it is not a JSON object."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _listing(entries: list[str]) -> str:
    shown = ", ".join(entries[:3])
    return shown + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")


def _flat(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__
