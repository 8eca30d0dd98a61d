"""Regeneration in-process on several GPUs: one worker process per GPU, each with its own journal.

A target small enough to regenerate in-process fits on one GPU, so a node's other GPUs would sit
idle. With N workers, each a whole copy of the target pinned to one GPU (``CUDA_VISIBLE_DEVICES``),
worker i answers every N-th conversation still to do and journals into
``regenerated.worker{i}.jsonl``. Every run first reads *all* journals in DATA_DIR (the single-process
``regenerated.jsonl`` too), so a killed run resumes with the same or another number of workers, and
nothing finished is generated twice.

Workers talk to the parent through files only (their input as JSONL, their options and statistics
as JSON, their output in a log), never through pickled objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from eyas.data.conversation import Conversation
from eyas.data.regenerate import (
    MAX_FAILURES_KEPT,
    RegenerationOptions,
    RegenerationStats,
    check_journal_matches,
    claim_answer_settings,
    make_generator,
    parse_journal,
    regenerate,
)
from eyas.errors import EyasError
from eyas.io import atomic_path, write_json_atomic

SINGLE_JOURNAL = "regenerated.jsonl"
_POLL_SECONDS = 1.0


def worker_gpus(workers: int | None) -> list[str]:
    """The device ids the workers run on: ``workers`` of the visible GPUs (all of them for None).

    Ids are taken from the parent's ``CUDA_VISIBLE_DEVICES`` when it is set, so a user who narrowed
    the visible GPUs keeps that choice. Without CUDA there are no GPUs: one worker, in this process.
    """
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()][:count] if visible else [str(i) for i in range(count)]
    if workers is None:
        return ids
    if workers > max(1, len(ids)):
        raise EyasError(f"--workers {workers} asks for one GPU per worker, but {len(ids)} GPU(s) are visible; "
                        f"use --workers {max(1, len(ids))} or fewer")
    return ids[:workers]


def journals(out: Path) -> list[Path]:
    """Every regeneration journal in DATA_DIR: the single-process one and each worker's."""
    return sorted(p for p in out.glob("regenerated*.jsonl") if p.is_file())


def read_finished(out: Path, conversations: list[Conversation]) -> dict[str, Conversation]:
    """All conversations finished in any journal (first one wins), each checked against the input."""
    return _read_journals(journals(out), conversations)


def _read_journals(paths: list[Path], conversations: list[Conversation]) -> dict[str, Conversation]:
    finished: dict[str, Conversation] = {}
    for journal in paths:
        found = parse_journal(journal, journal.read_bytes())
        check_journal_matches(journal, found, conversations)
        for cid, conversation in found.items():
            finished.setdefault(cid, conversation)
    return finished


def answer_set_dirs(out: Path, options: RegenerationOptions) -> list[tuple[Path, RegenerationOptions]]:
    """Where each set of answers keeps its journals, with its options: one temperature's in ``out`` itself; with
    several, each temperature's in its own folder ``out/regenerated-T{t}`` (a journal never resumes answers drawn at
    another temperature)."""
    sets = options.answer_sets()
    if len(sets) == 1:
        return [(Path(out), sets[0])]
    return [(Path(out) / f"regenerated-T{one.sampling_temperature:g}", one) for one in sets]


def regenerate_in_dir(
    conversations: list[Conversation],
    out: Path,
    target_spec: str | None,
    options: RegenerationOptions,
    workers: int | None = 1,
    progress: bool = True,
    chat_template: str | None = None,
) -> tuple[list[Conversation], RegenerationStats]:
    """Regenerate what no journal holds yet, at each of ``options``' temperatures (:func:`answer_set_dirs`); return
    every finished conversation of each set in input order, set after set (a conversation's id once per set), and the
    sets' statistics summed.

    ``workers`` > 1 (or None: one per visible GPU) runs that many worker processes, one per GPU; a
    server (``options.server``) or a single GPU runs in this process. ``chat_template``: the text the
    in-process target is prompted with instead of its tokenizer's (prepare's --chat-template).
    """
    answered: list[Conversation] = []
    each_set = []
    loaded: dict = {}  # the in-process target, loaded once for every set of answers
    for directory, one in answer_set_dirs(out, options):
        done, stats = _regenerate_one_set(conversations, directory, target_spec, one, workers, progress, chat_template,
                                          loaded)
        answered += done
        each_set.append(asdict(stats))
    return answered, _summed(each_set)


def _regenerate_one_set(conversations: list[Conversation], out: Path, target_spec: str | None,
                        options: RegenerationOptions, workers: int | None, progress: bool,
                        chat_template: str | None, loaded: dict) -> tuple[list[Conversation], RegenerationStats]:
    """One temperature's answers: what no journal in ``out`` holds yet regenerated, every finished one returned."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    claim_answer_settings(out, options, journaled=bool(journals(out)))
    finished = read_finished(out, conversations)
    todo = [c for c in conversations if c.id not in finished]
    gpus = [] if options.server else worker_gpus(workers)
    if len(gpus) <= 1 or not todo:
        generator = make_generator(options, target_spec, chat_template, loaded) if todo else None
        done, stats = regenerate(todo, out / SINGLE_JOURNAL, generator, options, progress=progress)
    else:
        stats, written = _run_workers(todo, out, target_spec, options, gpus, progress, chat_template)
        done = _read_journals(written, todo).values()  # what the worker processes journaled
    stats.conversations_resumed = len(conversations) - len(todo)
    for conversation in done:
        finished.setdefault(conversation.id, conversation)
    return [finished[c.id] for c in conversations if c.id in finished], stats


# --------------------------------------------------------------------------- the parent's side


def _run_workers(todo, out: Path, target_spec, options, gpus: list[str], progress: bool,
                 chat_template: str | None = None) -> tuple[RegenerationStats, list[Path]]:
    """Start one worker per GPU on every len(gpus)-th conversation, follow their journals; return the
    summed stats and the journals written."""
    write_json_atomic(out / "regenerate-options.json", {**asdict(options), "chat_template": chat_template})
    procs = []
    try:
        for i, gpu in enumerate(gpus):
            shard = todo[i::len(gpus)]
            if not shard:
                continue
            with atomic_path(out / f"regenerate-input.worker{i}.jsonl") as tmp:
                tmp.write_text("".join(json.dumps(c.to_json(), ensure_ascii=False) + "\n" for c in shard),
                               encoding="utf-8")
            stats_path = out / f"regenerate-stats.worker{i}.json"
            stats_path.unlink(missing_ok=True)  # a stale file must not pass for this run's result
            log = out / f"regenerate.worker{i}.log"
            command = [sys.executable, "-m", "eyas.data.regenerate_workers",
                       str(out / f"regenerate-input.worker{i}.jsonl"), str(out / f"regenerated.worker{i}.jsonl"),
                       str(out / "regenerate-options.json"), target_spec or "", str(stats_path)]
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1")
            with open(log, "wb") as handle:
                procs.append((i, subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)))
        written = [out / f"regenerated.worker{i}.jsonl" for i, _ in procs]
        _follow(procs, written, len(todo), progress)
    finally:
        for _, proc in procs:  # interrupted (Ctrl-C): stop the workers; what they journaled stays
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    failed = [(i, proc.returncode) for i, proc in procs if proc.returncode != 0]
    if failed:
        i, code = failed[0]
        log = out / f"regenerate.worker{i}.log"
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise EyasError(f"regeneration worker {i} (GPU {gpus[i]}) exited with status {code}; its log is {log}. "
                        f"Finished conversations are journaled: rerun to resume. Last lines:\n{tail}")
    stats = _sum_stats([out / f"regenerate-stats.worker{i}.json" for i, _ in procs])
    for i, _ in procs:  # the hand-over files are spent (the inputs are as big as the data); logs stay
        for spent in (f"regenerate-input.worker{i}.jsonl", f"regenerate-stats.worker{i}.json"):
            (out / spent).unlink(missing_ok=True)
    (out / "regenerate-options.json").unlink(missing_ok=True)
    return stats, written


def _follow(procs, journal_paths: list[Path], total: int, progress: bool) -> None:
    """Wait for the workers, showing conversations finished (complete journal lines written this run)."""
    from eyas.progress import progress_bar

    start_sizes = {p: (p.stat().st_size if p.exists() else 0) for p in journal_paths}
    offsets = dict(start_sizes)
    with progress_bar(f"regenerating on {len(procs)} GPUs", total=total, unit="conv", enabled=progress) as advance:
        while True:
            running = any(proc.poll() is None for _, proc in procs)
            for path in journal_paths:
                if path.exists() and path.stat().st_size > offsets[path]:
                    with open(path, "rb") as handle:
                        handle.seek(offsets[path])
                        new = handle.read()
                    whole = new[: new.rfind(b"\n") + 1]  # a line still being written counts next time
                    offsets[path] += len(whole)
                    advance(whole.count(b"\n"))
            if not running:
                return
            time.sleep(_POLL_SECONDS)


def _sum_stats(paths: list[Path]) -> RegenerationStats:
    """The workers' statistics files summed (a worker that wrote none counts nothing)."""
    return _summed([json.loads(path.read_text(encoding="utf-8")) for path in paths if path.exists()])


def _summed(each: list[dict]) -> RegenerationStats:
    """Several runs' statistics as one: counts added, the first MAX_FAILURES_KEPT failures kept."""
    total = RegenerationStats()
    for data in each:
        for f in fields(RegenerationStats):
            if f.name == "failures":
                total.failures.extend(data["failures"][: MAX_FAILURES_KEPT - len(total.failures)])
            else:
                setattr(total, f.name, getattr(total, f.name) + data[f.name])
    return total


# --------------------------------------------------------------------------- the worker's side


def _worker_main(argv: list[str]) -> None:
    """``python -m eyas.data.regenerate_workers INPUT JOURNAL OPTIONS TARGET STATS`` (started by the parent)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the worker's log: one line per batch
    input_path, journal, options_path, target, stats_path = argv
    raw = json.loads(Path(options_path).read_text(encoding="utf-8"))
    chat_template = raw.pop("chat_template", None)  # prepare's --chat-template, beside the options
    options = RegenerationOptions(**raw)
    conversations = [Conversation.from_json(json.loads(line))
                     for line in Path(input_path).read_bytes().split(b"\n") if line.strip()]  # not splitlines():
    # that also splits at U+2028 and friends, which JSON written with ensure_ascii=False keeps raw in strings
    generator = make_generator(options, target or None, chat_template)
    _, stats = regenerate(conversations, Path(journal), generator, options, progress=False)
    write_json_atomic(Path(stats_path), asdict(stats))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
