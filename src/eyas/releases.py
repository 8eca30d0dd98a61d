"""What a checkout of eyas ships in ``releases/``: drafters users can run and the data they came from, every file
pinned by sha256 in ``releases/MANIFEST.sha256`` (``sha256sum -c`` reads it)."""

from __future__ import annotations

from pathlib import Path

from eyas.errors import EyasError
from eyas.io import file_sha256

ROOT = Path(__file__).resolve().parents[2] / "releases"  # the checkout's folder (absent from an installed wheel)
MANIFEST = "MANIFEST.sha256"
DEMO_DRAFTER = "smollm2-135m-eagle3"  # the released drafter of the demo target: releases/<DEMO_DRAFTER>/


def read_manifest(root: Path = ROOT) -> dict[str, str]:
    """The manifest's entries, path (relative to ``root``, '/'-separated) → sha256; a malformed line is an error."""
    path = root / MANIFEST
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name:
            raise EyasError(f"{path} line {number} is not '<sha256>  <path>': {line!r}")
        if name in entries:
            raise EyasError(f"{path} lists {name} twice (line {number})")
        entries[name] = digest
    return entries


def write_manifest(root: Path = ROOT) -> None:
    """Rewrite the manifest over every file under ``root`` but itself, sorted by path (what :func:`read_manifest` reads)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    (root / MANIFEST).write_text("".join(f"{file_sha256(p)}  {p.relative_to(root).as_posix()}\n" for p in files))


def release_problems(folder: Path | None = None, root: Path = ROOT) -> list[str]:
    """What is wrong with the released files under ``folder`` (inside ``root``; all of ``root`` when None): files the
    manifest does not list, listed files that are missing or whose sha256 differs. Empty when all is as released."""
    entries = read_manifest(root)
    inside = Path(folder).resolve().relative_to(root.resolve()).as_posix() if folder is not None else "."
    prefix = "" if inside == "." else inside + "/"
    present = {p.relative_to(root).as_posix() for p in (root / prefix).rglob("*") if p.is_file()} - {MANIFEST}
    listed = {name for name in entries if name.startswith(prefix)}
    problems = [f"{name}: not in {MANIFEST}" for name in sorted(present - listed)]
    problems += [f"{name}: listed in {MANIFEST} but missing" for name in sorted(listed - present)]
    problems += [f"{name}: sha256 differs from {MANIFEST}" for name in sorted(listed & present)
                 if file_sha256(root / name) != entries[name]]
    return problems


def released_drafter(name: str = DEMO_DRAFTER, root: Path = ROOT) -> Path | None:
    """``releases/<name>`` when this checkout holds that drafter (its config.json), else None."""
    folder = root / name
    return folder if (folder / "config.json").is_file() else None
