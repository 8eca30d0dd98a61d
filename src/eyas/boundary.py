"""The command line's one error boundary: every mistake a user can cause ends as one line and exit code 2.

A user can cause an :class:`~eyas.errors.EyasError` (bad input, a broken setup: its message says what to do),
a command line click cannot parse (:func:`usage_message`: click's words on one line, not its usage box)
and an ``OSError`` about their paths — a full disk, no permission, a read-only filesystem, a path that does
not exist, a directory where a file belongs or the reverse. Anything else is a bug in eyas and keeps its
traceback. ``eyas --debug`` (or ``EYAS_DEBUG=1``) prints the traceback of a user error too.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from eyas.errors import EyasError

# click's UsageError as the typer in use raises it: typer ≥ 0.20 carries its own copy of click, older ones use click's
UsageError = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")

# errno → what it means for the path and what to do; a full disk or quota needs no path to be the user's
PATH_ERRORS = {
    errno.ENOSPC: ("no space left on the device", "free some space, or write --out to another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free some space, or write --out to another disk"),
    errno.EACCES: ("permission denied", "choose a path you may read and write, or change its permissions"),
    errno.EPERM: ("operation not permitted", "choose a path you may read and write, or change its permissions"),
    errno.EROFS: ("read-only filesystem", "write --out to a writable place"),
    errno.ENOENT: ("no such file or directory", "check the path"),
    errno.EISDIR: ("is a directory, where a file was expected", "give a file's path"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "check the path"),
    errno.EEXIST: ("already exists, in the way of what eyas writes", "remove it or choose another path"),
}
_NEEDS_NO_PATH = {errno.ENOSPC, errno.EDQUOT}


def user_message(error: BaseException) -> str | None:
    """The one line a user error prints (None: not a user error, a bug): the EyasError's message, or for an
    OSError about a path, the path, what went wrong and what to do."""
    if isinstance(error, EyasError):
        return " ".join(str(error).split())  # one line, whatever the message was built from
    if not isinstance(error, OSError) or error.errno not in PATH_ERRORS:
        return None
    if error.filename is None and error.errno not in _NEEDS_NO_PATH:
        return None
    what, todo = PATH_ERRORS[error.errno]
    paths = [str(p) for p in (error.filename, error.filename2) if p is not None]
    where = f"{' → '.join(paths)}: " if paths else ""
    return f"{where}{what}: {todo}"


def usage_message(error: UsageError) -> str:
    """The one line a command line click cannot parse prints (a misspelled flag, a value of the wrong type, a missing
    argument): click's own message, and where the command's options are listed."""
    names, ctx = [], error.ctx
    while ctx is not None and ctx.parent is not None:  # the root's name is how eyas was started: call it eyas
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    command = " ".join(["eyas", *names])
    return f"{' '.join(error.format_message().split())} ({command} --help lists what it takes)"


def debugging(flag: bool = False) -> bool:
    """Whether user errors show their traceback: ``eyas --debug`` (``flag``) or ``EYAS_DEBUG=1``."""
    return flag or os.environ.get("EYAS_DEBUG", "") not in ("", "0")


@contextmanager
def user_errors(console: Console, debug: bool = False) -> Iterator[None]:
    """Turn a user error into ``error: <one line>`` on ``console`` and exit code 2 (with ``debug`` or EYAS_DEBUG=1,
    after its traceback); a bug propagates with its traceback."""
    try:
        yield
    except UsageError as error:  # a flag misspelled or of the wrong type: click's words, on one line
        if debugging(debug):
            traceback.print_exc(file=sys.stderr)
        console.print(f"[bold red]error:[/] {escape(usage_message(error))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (EyasError, OSError) as error:
        message = user_message(error)
        if message is None:
            raise
        if debugging(debug):
            traceback.print_exc(file=sys.stderr)
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # "[train]" is text
        sys.exit(2)


class GuardedGroup(TyperGroup):
    """The ``eyas`` command group: every command it runs runs inside :func:`user_errors` (``--debug`` is its own flag)."""

    def invoke(self, ctx: click.Context):
        with user_errors(Console(stderr=True), bool(ctx.params.get("debug"))):
            return super().invoke(ctx)
