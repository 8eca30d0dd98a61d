"""RUN_DIR's record of what the run is (``train_options.json``) and what ``--resume`` may change in it.

``train_options.json`` holds the options the run started with, never rewritten, and ``segments``: the step each part
of the run began at (0, then every resume that trains or changes something), the data it read (role, path and the
SHA-256 of the directory's manifest: :func:`eyas.manifest.input_record`) and what it changed (``{option: {"from": ...,
"to": ...}}``), the target it trained against (:func:`target_identity`) and how many processes trained it
(``world``). A resume may change only :data:`eyas.train.options.RESUMABLE` and the paths of the data and of the
target (when their content is the same), and the number of processes when ``--grad-accum`` keeps the micro-batches
of a step (``--grad-accum`` × processes) what they were: the same batches, so the run continues exactly on another
GPU count. Anything else is refused before the target is loaded or anything is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eyas import families
from eyas.errors import EyasError
from eyas.manifest import input_record, jsonable, read_json_object
from eyas.train.options import DATA_OPTIONS, RESUMABLE, TrainOptions, trains_online
from eyas.train.run_dir import OPTIONS_FILE

SEGMENTS = "segments"
NOT_COMPARED = ("resume",)  # how this command was invoked, not what the run is
TARGET = "target"  # compared by content (:func:`target_identity`), like the data
WORLD = "world"  # a segment's number of processes (torchrun's WORLD_SIZE)
GRAD_ACCUM = "grad_accum"  # may change with the number of processes, their product kept (:func:`_accumulation_change`)


def read_run_record(run_dir: Path) -> dict | None:
    """``RUN_DIR/train_options.json``, or None when the run has none yet."""
    path = Path(run_dir) / OPTIONS_FILE
    if not path.is_file():
        return None
    remedy = "the RUN_DIR's record is damaged: start the run over with --force, or train into a new --out"
    record = read_json_object(path, remedy)
    segments = record.get(SEGMENTS, [])
    if not isinstance(segments, list) or not all(isinstance(s, dict) and type(s.get("step")) is int for s in segments):
        raise EyasError(f"{path}: its {SEGMENTS} are not a list of records with a step; {remedy}")
    return record


def run_options(record: dict) -> dict:
    """The options in effect after the record's last segment: those the run started with, then each resume's changes."""
    current = {name: value for name, value in record.items() if name != SEGMENTS}
    for segment in record.get(SEGMENTS, []):
        current.update({name: change["to"] for name, change in segment.get("changed", {}).items()})
    return current


def data_input(options: TrainOptions) -> dict:
    """What the run trains from, as a manifest input: DATA_DIR (online) or FEATURES_DIR, with its manifest's SHA-256."""
    role = "data" if trains_online(options.online, options.features, options.data) else "features"
    path = getattr(options, role)
    return input_record(role, path) if path is not None else {"role": role, "path": None, "sha256": None}


def target_identity(options: TrainOptions) -> dict:
    """The target as the run's record identifies it: its facts (sizes, config SHA-256) and, unless ``--no-verify``, the
    fingerprints of its weights (:mod:`eyas.target.fingerprint`); read from the checkpoint without loading the model."""
    from eyas.target.facts import target_facts
    from eyas.target.fingerprint import FINGERPRINTS, weights_fingerprint
    from eyas.target.loading import load_target_config

    config, source = load_target_config(options.target, options.trust_remote_code)
    weights = weights_fingerprint(options.target, options.trust_remote_code) if options.verify else \
        dict.fromkeys(FINGERPRINTS)
    return {**target_facts(options.target, config, source), **weights}


def resume_changes(record: dict, options: TrainOptions, step: int, out: Path, target: dict, world: int = 1) -> dict:
    """What resuming the recorded run from checkpoint ``step`` with ``options`` in ``world`` processes against ``target``
    (its :func:`target_identity`) changes (``{option: {"from", "to"}}``); a change :data:`RESUMABLE` does not allow,
    other micro-batches a step, other data or another target is an EyasError naming the option, both values and what
    to do."""
    before, now = run_options(_before(record, step)), jsonable(options)
    defaults = {f.name: jsonable(f.default) for f in dataclasses.fields(TrainOptions) if f.default is not dataclasses.MISSING}
    changed = _accumulation_change(before.get("grad_accum", defaults["grad_accum"]), _recorded_world(record, step),
                                   options.grad_accum, world, out)
    unread = families.unread_names(options.drafter)  # other families' options: recorded, never read by this run
    for name, value in now.items():
        if name in NOT_COMPARED or name in DATA_OPTIONS or name == GRAD_ACCUM or name in unread or \
                (name == TARGET and _recorded_target(record, step)):
            continue
        old = before.get(name, defaults.get(name))  # an option newer than the record: the run had its default
        if old == value:
            continue
        if name not in RESUMABLE:
            raise EyasError(_refusal(out, name, old, value))
        changed[name] = {"from": old, "to": value}
    return {**changed, **_data_change(_recorded_data(record, step), data_input(options), out),
            **_target_change(_recorded_target(record, step), target, out)}


def new_record(options: TrainOptions, target: dict, world: int = 1) -> dict:
    """The record of a run that starts at step 0 against ``target`` (its :func:`target_identity`) in ``world``
    processes."""
    return {**jsonable(options), SEGMENTS: [{"step": 0, "data": data_input(options), TARGET: target, WORLD: world}]}


def resumed_record(record: dict, options: TrainOptions, step: int, changes: dict, training: bool, target: dict,
                   world: int = 1) -> dict:
    """``record`` with a segment for the resume from ``step`` when it changes something or trains. A segment that
    began at or after ``step`` left no checkpoint behind (its run was killed before one): this one replaces it."""
    base = _before(record, step)
    if not changes and not training:  # a finished run run again: nothing to record
        return base
    segment = {"step": step, "data": data_input(options), TARGET: target, WORLD: world, "changed": changes}
    return {**base, SEGMENTS: [*base.get(SEGMENTS, []), segment]}


def _before(record: dict, step: int) -> dict:
    """``record`` without the segments that began at or after ``step``."""
    if SEGMENTS not in record:  # recorded before segments existed
        return record
    return {**record, SEGMENTS: [segment for segment in record[SEGMENTS] if segment["step"] < step]}


def _recorded_data(record: dict, step: int) -> dict:
    """The data input the run last read before ``step``; for a run recorded before segments existed, what its options
    name (no SHA-256)."""
    segments = _before(record, step).get(SEGMENTS, [])
    if segments:
        return segments[-1]["data"]
    options = run_options(record)
    role = "data" if trains_online(options.get("online"), options.get("features"), options.get("data")) else "features"
    return {"role": role, "path": options.get(role), "sha256": None}


def _recorded_target(record: dict, step: int) -> dict | None:
    """The target facts the run last recorded before ``step``; None for a run recorded before they were."""
    segments = _before(record, step).get(SEGMENTS, [])
    return segments[-1].get(TARGET) if segments else None


def _recorded_world(record: dict, step: int) -> int:
    """How many processes trained the run last before ``step``; 1 for a run recorded before segments said."""
    segments = _before(record, step).get(SEGMENTS, [])
    return segments[-1].get(WORLD, 1) if segments else 1


def _accumulation_change(old_accum: int, old_world: int, accum: int, world: int, out: Path) -> dict:
    """``--grad-accum``'s change: a step's micro-batches (``--grad-accum`` × processes) must stay what they were, so
    that every step averages the same batches; on another number of processes that takes another ``--grad-accum``."""
    if accum * world == old_accum * old_world:
        return {} if accum == old_accum else {GRAD_ACCUM: {"from": old_accum, "to": accum}}
    fits = old_accum * old_world % world == 0
    remedy = (f"resume with --grad-accum {old_accum * old_world // world}" if fits else
              f"resume on a number of processes that divides {old_accum * old_world}")
    raise EyasError(f"{out} was trained with {old_accum * old_world} micro-batches a step (--grad-accum {old_accum} × "
                    f"{old_world} process{'es' if old_world > 1 else ''}); this resume gives {accum * world} (--grad-accum "
                    f"{accum} × {world}): {remedy} to continue it exactly, or train into a new --out")


def _target_change(old: dict | None, new: dict, out: Path) -> dict:
    """The target's change: none when it is the same spec, its new spec when the same target moved (sizes, and weights
    or config, equal: :func:`eyas.target.facts.target_mismatch`); another target is refused."""
    if old is None:  # recorded before target facts were: the spec was compared with the other options
        return {}
    from eyas.target.facts import target_mismatch

    problem = target_mismatch(old, new)
    if problem:
        raise EyasError(f"{out} was trained against --target {old['spec']}; this resume gives --target {new['spec']}, "
                        f"another target ({problem}): resume against the run's target, or train into a new --out")
    return {} if old["spec"] == new["spec"] else {TARGET: {"from": old["spec"], "to": new["spec"]}}


def _data_change(old: dict, new: dict, out: Path) -> dict:
    """The data's change: none when it is the same data (by its manifest's SHA-256 where both have one, else by path),
    its new path when the same data moved; other data is refused."""
    if old["role"] == new["role"]:
        same = old["sha256"] == new["sha256"] if old["sha256"] and new["sha256"] else old["path"] == new["path"]
        if same:
            return {} if old["path"] == new["path"] else {old["role"]: {"from": old["path"], "to": new["path"]}}
    in_place = old["role"] == new["role"] and old["path"] == new["path"]
    how = " (its manifest.json differs from the one the run read)" if in_place else ""
    raise EyasError(f"{out} was trained from --{old['role']} {old['path']}; this resume gives --{new['role']} {_shown(new['path'])}"
                    f"{how}, but a resume must read the same data: resume with the run's data, or train into a new --out")


def _refusal(out: Path, name: str, old, new) -> str:
    from eyas.options import field_flag

    flags = {f.name: field_flag(f).split("/")[0] for f in dataclasses.fields(TrainOptions)}
    allowed = ", ".join(flags[n] for n in sorted(RESUMABLE - {"out"}))
    given = f"without {flags[name]}" if old is None else f"with {flags[name]} {_shown(old)}"
    return (f"{out} was trained {given}; this resume gives {flags[name]} {_shown(new)}, but a resume may change only "
            f"{allowed}: resume {given} (train.{name} in a run config), or train into a new --out")


def _shown(value) -> str:
    """A recorded option value as it is spelled on the command line."""
    if value is None:
        return "(not given)"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)
