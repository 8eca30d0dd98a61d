"""One progress-bar style for every long loop: count, rate, elapsed and ETA, on stderr."""

from __future__ import annotations

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


class _Bar:
    """Handle of a running bar: call it to advance, ``note()`` to show extra text (e.g. bytes written)."""

    def __init__(self, progress: Progress, task, unit: str):
        self._progress, self._task, self._unit = progress, task, unit

    def __call__(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)
        speed = self._progress.tasks[self._task].speed
        if speed:
            self._progress.update(self._task, rate=f"{speed:,.1f} {self._unit}/s")

    def note(self, text: str) -> None:
        self._progress.update(self._task, note=text)


@contextmanager
def progress_bar(description: str, total: int | None, unit: str = "it") -> Iterator[_Bar]:
    """A bar for ``total`` items on stderr (when it is a terminal); yields a handle that advances it."""
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
    with Progress(*columns, console=_stderr, transient=False, disable=not _stderr.is_terminal) as progress:
        yield _Bar(progress, progress.add_task(description, total=total, rate="", note=""), unit)
