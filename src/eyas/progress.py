"""One progress-bar style for every long loop: count, rate, elapsed and ETA, on stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


@contextmanager
def progress_bar(description: str, total: int | None, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """A bar for ``total`` items; yields ``advance(n)``. Rates are shown in ``unit``/s."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("[cyan]{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=_stderr, transient=False, disable=not _stderr.is_terminal) as progress:
        task = progress.add_task(description, total=total, rate="")

        def advance(n: int = 1) -> None:
            progress.advance(task, n)
            speed = progress.tasks[task].speed
            if speed:
                progress.update(task, rate=f"{speed:,.1f} {unit}/s")

        yield advance
