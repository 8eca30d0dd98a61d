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
import os
import re
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from eyas import __version__
from eyas.errors import EyasError
from eyas.io import file_sha256, write_json_atomic

MANIFEST = "manifest.json"
FORMATS = {"prepare": "eyas-data/1", "capture": "eyas-features/1", "train": "eyas-run/1", "export": "eyas-draft/1",
           "bench": "eyas-report/1"}
DIRECTORIES = {"prepare": "DATA_DIR", "capture": "FEATURES_DIR", "train": "RUN_DIR", "export": "DRAFT_DIR",
               "bench": "REPORT_DIR"}
REMEDIES = {  # what to do when a finished stage directory is damaged
    "prepare": "rerun the eyas prepare command that wrote it, with --force",
    "capture": "rerun the eyas capture command that made it",
    "train": "rerun the eyas train command that made it, with --resume: it rewrites final/ from the last checkpoint",
    "export": "export it again (eyas export RUN_DIR --out DRAFT_DIR)",
    "bench": "rerun the eyas bench command that wrote it",
}
CHANGED = "its SHA-256 differs from the manifest's (the bytes changed after they were written)"  # file_problem's verdict
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


def read_stage_manifest(directory: Path, stage: str) -> dict:
    """``directory/manifest.json`` of a finished ``stage`` directory, or an error naming the file and what to do: it is
    missing, not JSON, another stage's, or of a format version this eyas does not read. A manifest without ``format``
    (older eyas) is accepted."""
    directory, kind = Path(directory), DIRECTORIES[stage]
    path = directory / MANIFEST
    if not path.is_file():
        what = f"{directory} does not exist" if not directory.exists() else f"{path} is missing"
        raise EyasError(f"{what}: not a finished {kind}; give the directory eyas {stage} wrote (or rerun eyas {stage} "
                        "to finish it)")
    manifest = read_json_object(path, f"the {kind} is damaged; rerun eyas {stage} to rewrite it")
    found = manifest.get("format", FORMATS[stage])
    if found != FORMATS[stage]:
        other = next((s for s, f in FORMATS.items() if f == found), None)
        if other is not None:
            raise EyasError(f"{directory} is a {DIRECTORIES[other]} (written by eyas {other}), not a {kind}: give the "
                            f"directory eyas {stage} wrote")
        if str(found).split("/")[0] == FORMATS[stage].split("/")[0]:
            raise EyasError(f"{path} has format {found}, and this eyas ({__version__}) reads {FORMATS[stage]}: it was "
                            "written by another eyas version; upgrade eyas, or rerun eyas " + stage)
        raise EyasError(f"{path} has format {found!r}: not an eyas {kind}; give the directory eyas {stage} wrote")
    return manifest


def read_json_object(path: Path, remedy: str) -> dict:
    """A JSON file holding an object, or one line naming it, what is wrong (not JSON, not an object) and ``remedy``."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise EyasError(f"{path} is not valid JSON ({err}); {remedy}") from None
    if not isinstance(value, dict):
        raise EyasError(f"{path} holds no JSON object; {remedy}")
    return value


def file_problem(path: Path, size: int, sha256: str | None, digest: bool = True) -> str | None:
    """What is wrong with a file a manifest records (its ``size`` in bytes and ``sha256``): missing, another size, or —
    when ``digest`` — other bytes; None when it is intact. The one integrity check of every stage's outputs."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    found = path.stat().st_size
    if found != size:
        return f"{found:,} bytes where the manifest records {size:,} (truncated or replaced)"
    if digest and sha256 is not None and file_sha256(path) != sha256:
        return CHANGED
    return None


def output_problems(directory: Path, manifest: dict, digest: bool = True) -> list[str]:
    """``"PATH: problem"`` for each output file ``manifest`` records that is missing or changed (none in a manifest of
    an older eyas, which records no outputs)."""
    directory = Path(directory)
    records = manifest.get("outputs") or []
    if not isinstance(records, list):
        return [f"{directory / MANIFEST}: its outputs are not a list of file records"]
    problems = []
    for record in records:
        if not _is_output_record(record):
            problems.append(f"{directory / MANIFEST}: the output record {json.dumps(record)[:80]} is damaged")
            continue
        problem = file_problem(directory / record["file"], record["bytes"], record.get("sha256"), digest)
        if problem is not None:
            problems.append(f"{directory / record['file']}: {problem}")
    return problems


def _is_output_record(record) -> bool:
    """An output record as :func:`output_record` writes it: a file name inside the directory, its bytes, a SHA-256."""
    if not isinstance(record, dict) or not isinstance(record.get("file"), str) or type(record.get("bytes")) is not int:
        return False
    name = Path(record["file"])
    return not name.is_absolute() and ".." not in name.parts and isinstance(record.get("sha256"), (str, type(None)))


def verify_stage_dir(directory: Path, stage: str, digest: bool = True) -> dict:
    """The manifest of a finished ``stage`` directory whose recorded outputs are all intact (:func:`output_problems`),
    or an error naming the first damaged file and what to do."""
    manifest = read_stage_manifest(directory, stage)
    problems = output_problems(directory, manifest, digest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise EyasError(f"{problems[0]}{more}: the {DIRECTORIES[stage]} is not what eyas {stage} wrote; {REMEDIES[stage]}")
    return manifest


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
    """The commit of the eyas source tree: the one the environment names in ``EYAS_COMMIT`` (hex, 7–64 digits) — the
    device scripts set it, since a copy of the tree on a device machine has no .git or another commit's — else ``git
    rev-parse HEAD`` of the checkout holding src/; an installed package without either: None."""
    named = os.environ.get("EYAS_COMMIT", "").strip().lower()
    if re.fullmatch(r"[0-9a-f]{7,64}", named):
        return named
    root = Path(__file__).resolve().parents[2]  # src/eyas/manifest.py → the checkout holding src/
    if not (root / ".git").exists() or not (root / "src" / "eyas").is_dir():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", commit) else None
