"""RUN_DIR's files besides checkpoints and metrics: how the run was asked for, what export needs, what it ended with.

Written when a run starts (or resumes): ``train_options.json`` (the options it started with and each segment's changes:
:mod:`eyas.train.resume`), ``drafter_config.json`` and ``target.json`` — the
target facts (:func:`eyas.target.facts.target_facts`: spec, config SHA-256, architecture, text model type, layer
count, hidden and vocabulary sizes) and the layer ids, so that ``eyas export`` never loads the target. Written when
it finishes: ``final/`` (``model.safetensors`` + ``drafter_config.json``), ``report.json``, then ``manifest.json``
last (:mod:`eyas.manifest`): its presence means the run finished. Where the last step was checkpointed, the final
weights are that checkpoint's ``model.safetensors`` under a second name (a hard link), not a copy: a finished run takes
the disk of its checkpoints alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from eyas.io import write_json_atomic
from eyas.manifest import clear_manifest, write_manifest
from eyas.outputs import writing

TARGET_FILE = "target.json"
OPTIONS_FILE = "train_options.json"
STARTED_FILES = (OPTIONS_FILE, "drafter_config.json", TARGET_FILE)
FINISHED_FILES = ("final/model.safetensors", "final/drafter_config.json", "report.json", "metrics.jsonl")
MARKERS = (*STARTED_FILES, "checkpoints", "metrics.jsonl", "tensorboard")  # what a run writes before its manifest.json


def start_run_dir(out: Path, record: dict, drafter_config: dict, target: dict) -> None:
    """Write what a starting (or resuming) run is: its record (train_options.json), drafter config and target facts;
    until it finishes, no manifest claims the run is done."""
    out = Path(out)
    clear_manifest(out)
    write_json_atomic(out / OPTIONS_FILE, record)
    write_json_atomic(out / "drafter_config.json", drafter_config)
    write_json_atomic(out / TARGET_FILE, target)


def clear_run_dir(out: Path) -> None:
    """Remove what a run wrote (``--force`` without ``--resume``: start over); other files in ``out`` stay."""
    out = Path(out)
    clear_manifest(out)
    for name in (*MARKERS, "final", "report.json"):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def finish_run_dir(out: Path, drafter, state: dict, report: dict, options, inputs: list[dict]) -> None:
    """Write the final weights and config, report.json, then manifest.json last."""
    from safetensors.torch import save_file

    from eyas.io import atomic_path
    from eyas.train.checkpoint import checkpointed_weights, drafter_tensors

    out = Path(out)
    final = out / "final"
    tensors = drafter_tensors(drafter, state)
    twin = checkpointed_weights(out, tensors)  # the last step's checkpoint holds these weights: one file on disk
    with writing(final, "the last checkpoint is intact: free space, then the same command with --resume writes the "
                 "final weights"):
        final.mkdir(exist_ok=True)
        with atomic_path(final / "model.safetensors") as tmp:
            if twin is None or not _linked(twin, tmp):
                save_file(tensors, str(tmp))
        write_json_atomic(final / "drafter_config.json", drafter.config.to_dict())
        write_json_atomic(out / "report.json", report)
        write_manifest(out, "train", options, inputs, STARTED_FILES + FINISHED_FILES)


def _linked(existing: Path, path: Path) -> bool:
    """``path`` made a second name of ``existing`` (a hard link: no bytes copied; both are only ever replaced whole,
    never written in place); False where the filesystem has no hard links."""
    try:
        os.link(existing, path)
    except OSError:
        return False
    return True


def read_target_facts(run_dir: Path) -> dict | None:
    """The target facts a run recorded (``target.json``), or None for a run made before runs recorded them."""
    path = Path(run_dir) / TARGET_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
