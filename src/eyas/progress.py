"""One progress style for every long loop: count, rate, elapsed and ETA, on stderr.

On a terminal it is a live bar. Elsewhere (nohup, CI, a SLURM log) a bar would print nothing until
the loop ends, and a user could not tell progress from a hang; there the same handle writes one
plain line every ``LOG_EVERY_SECONDS`` (and a last one when the loop ends).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

_stderr = Console(stderr=True)
LOG_EVERY_SECONDS = 30.0


def rate_text(per_second: float, unit: str) -> str:
    """``12.3 step/s``, or per minute when under one a second (``4.5 conv/min``)."""
    if 0 < per_second < 1:
        return f"{per_second * 60:,.1f} {unit}/min"
    return f"{per_second:,.1f} {unit}/s"


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _Bar:
    """Handle of a running bar: call it to advance, ``note()`` to show extra text (e.g. bytes written)."""

    def __init__(self, progress: Progress, task, unit: str):
        self._progress, self._task, self._unit = progress, task, unit

    def __call__(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)
        speed = self._progress.tasks[self._task].speed
        if speed:
            self._progress.update(self._task, rate=rate_text(speed, self._unit))

    def note(self, text: str) -> None:
        self._progress.update(self._task, note=text)


class _LogLines:
    """The same handle off a terminal: a line of text every ``every`` seconds, and one at the end."""

    def __init__(self, description: str, total: int | None, unit: str, every: float, stream=None):
        self._description, self._total, self._unit, self._every = description, total, unit, every
        self._stream = stream or sys.stderr
        self._done, self._first, self._text = 0, None, ""
        self._started = self._last = time.monotonic()

    def __call__(self, n: int = 1) -> None:
        self._done += n
        if self._first is None:  # the rate counts from the first advance: one before it (a resumed run's steps) is not timed
            self._first = (time.monotonic(), self._done)
        if time.monotonic() - self._last >= self._every:
            self.line()

    def note(self, text: str) -> None:
        self._text = text

    def line(self) -> None:
        """Write the current state now."""
        now = time.monotonic()
        self._last = now
        count = f"{self._done:,}/{self._total:,} {self._unit}" if self._total else f"{self._done:,} {self._unit}"
        if self._total:
            count += f" ({100 * self._done / self._total:.0f} %)"
        parts = [f"{self._description}: {count}"]
        since, at = self._first or (now, self._done)
        if now > since and self._done > at:
            speed = (self._done - at) / (now - since)
            parts.append(rate_text(speed, self._unit))
            if self._total:
                parts.append(f"ETA {_clock((self._total - self._done) / speed)}")
        parts.append(f"{_clock(now - self._started)} elapsed")
        if self._text:
            parts.append(self._text)
        print(", ".join(parts), file=self._stream, flush=True)


@contextmanager
def progress_bar(description: str, total: int | None, unit: str = "it", *, enabled: bool = True,
                 log_every: float = LOG_EVERY_SECONDS) -> Iterator[_Bar | _LogLines]:
    """Progress of ``total`` items on stderr: a bar on a terminal, else a log line every ``log_every`` s.

    Yields a handle: call it to advance by n, ``.note(text)`` to add text. ``enabled=False`` shows nothing.
    """
    if not _stderr.is_terminal:
        lines = _LogLines(description, total, unit, log_every if enabled else float("inf"))
        yield lines
        if enabled:
            lines.line()
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("[cyan]{task.fields[rate]}"),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=_stderr, transient=False, disable=not enabled) as progress:
        yield _Bar(progress, progress.add_task(description, total=total, rate="", note=""), unit)
