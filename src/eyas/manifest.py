"""Stage manifests: every stage directory says what wrote it, how, from what, and what it holds.

Each stage writes ``manifest.json`` the same way, atomically and last, so its presence means the stage
finished. The common fields: ``format`` (names the directory: ``eyas-data/1``, ``eyas-features/1``,
``eyas-run/1``, ``eyas-draft/1``, ``eyas-report/1``), ``stage``, ``eyas_version``, ``git_commit`` (of the
eyas source tree when it is a git checkout, else null), ``created`` (UTC), ``options`` (the stage's
options, JSON-ready), ``inputs`` (role, the path as given, and the SHA-256 of what identifies the input)
and ``outputs`` (file, bytes, SHA-256). A stage adds its own fields beside them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from eyas import __version__
from eyas.io import file_sha256, write_json_atomic

MANIFEST = "manifest.json"
FORMATS = {"prepare": "eyas-data/1", "capture": "eyas-features/1", "train": "eyas-run/1", "export": "eyas-draft/1",
           "bench": "eyas-report/1"}
COMMON_FIELDS = ("format", "stage", "eyas_version", "git_commit", "created", "options", "inputs", "outputs")


def manifest_fields(stage: str, options, inputs: list[dict], directory: Path | None = None,
                    outputs: Iterable[str] = ()) -> dict:
    """The fields every stage manifest has; ``outputs`` are file names under ``directory``, recorded with bytes and SHA-256."""
    return {
        "format": FORMATS[stage],
        "stage": stage,
        "eyas_version": __version__,
        "git_commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "options": jsonable(options),
        "inputs": inputs,
        "outputs": [output_record(Path(directory), name) for name in outputs] if directory is not None else [],
    }


def write_manifest(directory: Path, stage: str, options, inputs: list[dict], outputs: Iterable[str], **fields) -> dict:
    """Write ``directory/manifest.json`` atomically: the common fields, then the stage's own; call it last."""
    manifest = {**manifest_fields(stage, options, inputs, directory, outputs), **fields}
    write_json_atomic(Path(directory) / MANIFEST, manifest)
    return manifest


def clear_manifest(directory: Path) -> None:
    """Remove ``directory/manifest.json`` before a stage rewrites the directory: until the new one is written, nothing
    claims the directory is finished."""
    (Path(directory) / MANIFEST).unlink(missing_ok=True)


def read_manifest(directory: Path) -> dict | None:
    """``directory/manifest.json`` as a dict, or None when there is none."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def input_record(role: str, path, sha256: str | None = None) -> dict:
    """An input as a manifest lists it: its role, the path as given, and the SHA-256 of what identifies it — ``sha256``
    when given, else a directory's manifest.json or a file's bytes (None for anything else, e.g. a hub id)."""
    if sha256 is None:
        local = Path(path)
        if (local / MANIFEST).is_file():
            sha256 = file_sha256(local / MANIFEST)
        elif local.is_file():
            sha256 = file_sha256(local)
    return {"role": role, "path": str(path), "sha256": sha256}


def output_record(directory: Path, name: str) -> dict:
    """A written file as a manifest lists it: its name under ``directory``, bytes and SHA-256."""
    path = Path(directory) / name
    return {"file": name, "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def jsonable(value):
    """Options as JSON: dataclasses become dicts, paths strings, tuples lists; other objects their ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


@functools.cache
def git_commit() -> str | None:
    """The commit of the eyas source tree when it is a git checkout (an installed package has none: None)."""
    root = Path(__file__).resolve().parents[2]  # src/eyas/manifest.py → the checkout holding src/
    if not (root / ".git").exists() or not (root / "src" / "eyas").is_dir():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", commit) else None
