"""Regeneration: replace every assistant turn with the target's own answer, resumably.

Training a drafter on the target's own outputs teaches it what the target will actually say.
Answers are generated turn by turn, so each is conditioned on the target's earlier answers, not
on the dataset's. Finished conversations are appended to a JSONL journal (flushed and fsynced),
so a run killed at any moment resumes where it stopped and ends with each conversation once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO

from eyas.data.conversation import Conversation, Turn
from eyas.data.generators import Answer, GenerationError, HFGenerator, OpenAIServerGenerator, TurnGenerator
from eyas.data.options import RegenerationOptions
from eyas.errors import EyasError
from eyas.io import write_json_atomic
from eyas.options import field_flag

log = logging.getLogger(__name__)

__all__ = [
    "Answer",
    "GenerationError",
    "HFGenerator",
    "JournalError",
    "OpenAIServerGenerator",
    "RegenerationOptions",
    "RegenerationStats",
    "TurnGenerator",
    "make_generator",
    "regenerate",
]

MAX_FAILURES_KEPT = 50


@dataclass
class RegenerationStats:
    """What one run did; failed conversations are not journaled, so a rerun retries them."""

    conversations_done: int = 0  # finished in this run
    conversations_resumed: int = 0  # found already finished in the journal
    conversations_failed: int = 0  # gave up after retries
    turns_generated: int = 0  # answers in the conversations finished in this run
    answers_truncated: int = 0  # of those, stopped by max_new_tokens
    failures: list[str] = field(default_factory=list)  # "id: reason", the first MAX_FAILURES_KEPT


class JournalError(EyasError):
    """The journal cannot be used: unreadable, written for other data, or held by another run."""


def make_generator(options: RegenerationOptions, target_spec: str | None, chat_template: str | None = None,
                   loaded: dict | None = None) -> TurnGenerator:
    """The server generator when ``options.server`` is set (the server applies its own template), else the target
    loaded in-process, prompted with ``chat_template`` (a --chat-template file's text) or its tokenizer's.
    ``loaded``: targets already loaded, by spec (one load serves every set of answers of a run), added to."""
    if options.server:
        return OpenAIServerGenerator(options)
    if not target_spec:
        raise EyasError("regeneration needs a target to load in-process, or --server pointing at one already served")
    from eyas.target.loading import load_target

    loaded = {} if loaded is None else loaded
    if target_spec not in loaded:
        loaded[target_spec] = load_target(target_spec)
    target = loaded[target_spec]
    return HFGenerator(target.model, target.tokenizer, options, chat_template)


def regenerate(
    conversations: list[Conversation],
    journal: Path,
    generator: TurnGenerator,
    options: RegenerationOptions,
    progress: bool = True,
) -> tuple[list[Conversation], RegenerationStats]:
    """Regenerate every conversation not yet in ``journal``; return the finished ones in input order."""
    _reject_duplicate_ids(conversations)
    journal = Path(journal)
    stats = RegenerationStats()
    with _open_journal(journal) as handle:
        finished = _read_journal(journal, handle)
        check_journal_matches(journal, finished, conversations)
        todo = [c for c in conversations if c.id not in finished]
        stats.conversations_resumed = len(conversations) - len(todo)
        # Answers are generated depth by depth within a chunk, so a chunk of conversations with equally many
        # answers fills every batch at every depth; mixed depths would leave deep levels nearly empty.
        # Shallow ones first: they finish (and are journaled) soonest.
        todo.sort(key=lambda c: len(_Work(c).slots))

        with _progress_bar(progress, total=len(conversations), resumed=stats.conversations_resumed) as advance:

            def on_done(conversation: Conversation, answers: list[Answer]) -> None:
                _append(handle, conversation)
                finished[conversation.id] = conversation
                stats.conversations_done += 1
                stats.turns_generated += len(answers)
                stats.answers_truncated += sum(a.truncated for a in answers)
                advance(stats)

            def on_failed(conversation: Conversation, reason: str) -> None:
                stats.conversations_failed += 1
                if len(stats.failures) < MAX_FAILURES_KEPT:  # said at once: a run killed later still told why
                    stats.failures.append(f"{conversation.id}: {reason}")
                    log.warning("conversation %s failed (not journaled; a rerun retries it): %s", conversation.id,
                                reason)
                advance(stats)

            # In-process, a chunk spans several batches so that the later (fewer) turns still fill batches.
            chunk = max(1, options.concurrency) if options.server else max(1, options.batch_size) * 4
            for start in range(0, len(todo), chunk):
                _regenerate_chunk(todo[start:start + chunk], generator, on_done, on_failed)
    return [finished[c.id] for c in conversations if c.id in finished], stats


# --------------------------------------------------------------------------- turn by turn


class _Work:
    """One conversation in flight: its turns so far and the positions that still need an answer."""

    def __init__(self, conversation: Conversation):
        self.source = conversation
        self.turns = list(conversation.turns)
        self.slots = [i for i, t in enumerate(self.turns) if t.role == "assistant"]
        if self.turns and self.turns[-1].role == "user":  # prompt-only data: answer the last question too
            self.slots.append(len(self.turns))
        self.answers: list[Answer] = []

    def prompt(self, depth: int) -> list[dict[str, str]]:
        """Everything before the ``depth``-th answer, earlier answers already the target's."""
        return [{"role": t.role, "content": t.content} for t in self.turns[:self.slots[depth]]]

    def fill(self, depth: int, answer: Answer) -> None:
        turn = Turn("assistant", answer.text, regenerated=True, truncated=answer.truncated)
        slot = self.slots[depth]
        if slot == len(self.turns):
            self.turns.append(turn)
        else:
            self.turns[slot] = turn
        self.answers.append(answer)

    def result(self) -> Conversation:
        return Conversation(id=self.source.id, turns=self.turns, origin=self.source.origin)


def _regenerate_chunk(
    chunk: list[Conversation],
    generator: TurnGenerator,
    on_done: Callable[[Conversation, list[Answer]], None],
    on_failed: Callable[[Conversation, str], None],
) -> None:
    """Depth by depth: all first answers in one generate call, then all second answers, and so on."""
    pending = []
    for work in map(_Work, chunk):
        if work.slots:
            pending.append(work)
        else:  # nothing to answer (e.g. a lone system turn): finished as it is
            on_done(work.result(), [])
    depth = 0
    while pending:
        results = generator.generate([w.prompt(depth) for w in pending])
        if len(results) != len(pending):
            raise RuntimeError(f"generator returned {len(results)} results for {len(pending)} prompts")
        still = []
        for work, result in zip(pending, results, strict=True):
            problem = _problem(result)
            if problem:
                on_failed(work.source, f"turn {work.slots[depth]}: {problem}")
                continue
            work.fill(depth, result)  # type: ignore[arg-type]  # _problem rules out exceptions
            if depth + 1 < len(work.slots):
                still.append(work)
            else:
                on_done(work.result(), work.answers)
        pending = still
        depth += 1


def _problem(result: Answer | Exception) -> str | None:
    """Why this result cannot be used, or None when it is a real answer."""
    if isinstance(result, Exception):
        return str(result) or type(result).__name__
    if not result.text.strip():
        return "empty answer" + (" (max_new_tokens reached before any text)" if result.truncated else "")
    return None


# --------------------------------------------------------------------------- journal


@contextmanager
def _open_journal(journal: Path) -> Iterator[IO[bytes]]:
    """Open for appending, holding an exclusive lock so two runs never interleave their lines."""
    journal.parent.mkdir(parents=True, exist_ok=True)
    with open(journal, "ab") as handle:
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform: rely on the user running one at a time
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as err:
                raise JournalError(f"journal {journal} is in use by another running regeneration; "
                                   "wait for it or stop it first") from err
        yield handle


def _read_journal(journal: Path, handle: IO[bytes]) -> dict[str, Conversation]:
    """Finished conversations by id (first one wins); a torn last line is cut off the file."""
    data = journal.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):  # a kill mid-write leaves a line without its newline: drop it
        handle.truncate(complete)
        handle.flush()
        os.fsync(handle.fileno())
    return parse_journal(journal, data)


def parse_journal(journal: Path, data: bytes) -> dict[str, Conversation]:
    """The complete lines of a journal's bytes as conversations by id (first one wins); a torn last
    line (a run killed mid-write, or one still writing) is ignored, not an error."""
    complete = data.rfind(b"\n") + 1
    finished: dict[str, Conversation] = {}
    for number, line in enumerate(data[:complete].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            conversation = Conversation.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError) as err:
            # Only the last line can be torn by a kill; a bad complete line means the file was damaged.
            raise JournalError(f"journal {journal} line {number} is not a conversation ({err}); "
                               "delete that line (it will be regenerated) or the whole file") from err
        finished.setdefault(conversation.id, conversation)
    return finished


def _append(handle: IO[bytes], conversation: Conversation) -> None:
    """One line per conversation, on disk before we go on: a kill loses at most a torn last line."""
    handle.write((json.dumps(conversation.to_json(), ensure_ascii=False) + "\n").encode("utf-8"))
    handle.flush()
    os.fsync(handle.fileno())


SETTINGS = "regenerated-settings.json"  # beside a folder's journals: what their answers were generated with


def answer_settings(options: RegenerationOptions) -> dict:
    """What shapes one set of answers (not how fast they come): its temperature, its length limit, and above T = 0
    its seed."""
    settings = {"temperature": options.sampling_temperature, "max_new_tokens": options.max_new_tokens}
    if options.sampling_temperature > 0:
        settings["seed"] = options.seed
    return settings


def claim_answer_settings(out: Path, options: RegenerationOptions, journaled: bool) -> None:
    """The journals in ``out`` hold answers of one setting (:func:`answer_settings`): a run asking for another is
    refused before it resumes them; the setting is recorded when the folder has no journal yet (one written before
    the record existed is resumed as it is)."""
    path, wanted = Path(out) / SETTINGS, answer_settings(options)
    if path.exists():
        try:
            held = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise JournalError(f"{path} is unreadable ({err}); delete it to resume the journals beside it") from err
        if held != wanted:
            flags = {f.name: field_flag(f) for f in fields(RegenerationOptions)}

            def said(settings: dict) -> str:
                return ", ".join(f"{flags.get(key, key)} {value:g}" for key, value in settings.items())

            raise JournalError(f"the journals in {out} hold answers generated with {said(held)}, not {said(wanted)}: "
                               f"rerun with those options to resume them, or delete {out}/regenerated*.jsonl and "
                               f"{SETTINGS} to answer again")
    elif not journaled:
        write_json_atomic(path, wanted)


def check_journal_matches(journal: Path, finished: dict[str, Conversation], conversations: list[Conversation]) -> None:
    """A journal written for other data must not be resumed: its system/user turns must be the input's."""
    for conversation in conversations:
        done = finished.get(conversation.id)
        if done is not None and _kept_turns(done) != _kept_turns(conversation):
            raise JournalError(
                f"journal {journal} holds conversation {conversation.id!r} with different system/user turns than "
                f"the input ({conversation.origin or 'no origin'}): it was written for other data. "
                "Delete it, or write to a fresh output, to regenerate from scratch"
            )


def _kept_turns(conversation: Conversation) -> list[tuple[str, str]]:
    return [(t.role, t.content) for t in conversation.turns if t.role != "assistant"]


def _reject_duplicate_ids(conversations: list[Conversation]) -> None:
    """The journal is keyed by id, so two conversations sharing one could not both be resumed."""
    seen: set[str] = set()
    duplicates = []
    for conversation in conversations:
        if conversation.id in seen:
            duplicates.append(f"{conversation.id!r} ({conversation.origin or 'no origin'})")
        seen.add(conversation.id)
    if duplicates:
        shown = ", ".join(duplicates[:5]) + (f" and {len(duplicates) - 5} more" if len(duplicates) > 5 else "")
        raise EyasError(f"{len(duplicates)} conversation id(s) occur more than once: {shown}; ids must be unique "
                        "for regeneration to resume")


# --------------------------------------------------------------------------- progress


@contextmanager
def _progress_bar(enabled: bool, total: int, resumed: int) -> Iterator[Callable[[RegenerationStats], None]]:
    """Yield ``advance(stats)``: one more conversation finished or failed (eyas' one progress style)."""
    from eyas.progress import progress_bar

    with progress_bar("regenerating", total=total, unit="conv", enabled=enabled) as bar:
        bar(resumed)

        def advance(stats: RegenerationStats) -> None:
            bar()
            bar.note(f"{stats.turns_generated} turns generated, {stats.conversations_failed} failed")

        yield advance
