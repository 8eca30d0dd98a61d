"""Command-line flags derived from options dataclasses: one typer parameter per field, instances back.

A field's flag is ``--name`` (underscores as dashes) unless its ``option(flag=...)`` says otherwise;
its default, help and check are the field's own, so the command line cannot drift from Python or a run
config: a value its check refuses is one line naming the flag and what it must be. A tuple is one
comma-separated flag (``--layer-ids 2,15,27``), a list a repeatable one, and a nested options
dataclass (prepare's regeneration) adds its fields as flags of their own.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Union

import typer

from eyas.errors import EyasError, OptionError
from eyas.options import field_flag


def command(app: typer.Typer, *classes: type, name: str | None = None, loose: bool = False) -> Callable:
    """Register the decorated function as a command whose flags are the fields of ``classes``.

    It is called with one instance of each class. Its help is its docstring, or else the first
    class's. ``loose``: required fields may be left out on the command line (they arrive as None).
    """

    def register(body: Callable) -> Callable:
        fields = _flat_fields(classes)
        parameters = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=_parameter(f, hint, loose),
                                        annotation=_annotation(hint)) for key, (f, hint) in fields.items()]

        def invoke(**values):
            return body(*(build(cls, values) for cls in classes))

        invoke.__signature__ = inspect.Signature(parameters)
        doc = body.__doc__ or classes[0].__doc__
        app.command(name=name or body.__name__, help=inspect.cleandoc(doc or ""))(invoke)
        return body

    return register


def build(cls: type, values: dict[str, Any]) -> Any:
    """An instance of ``cls`` from flat flag values (nested options dataclasses from the same values); a value
    its field's check refuses is an EyasError naming the flag."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    try:
        return cls(**kwargs)
    except OptionError as refused:
        field = next(f for f in dataclasses.fields(cls) if f.name == refused.name)
        value = refused.value
        shown = ",".join(str(v) for v in value) if isinstance(value, (tuple, list)) else str(value)
        raise EyasError(f"{_spelling(field)} {shown}: {refused.rule}") from None


def _spelling(f: dataclasses.Field) -> str:
    """How the command line spells a field: its flag, or a positional argument's name in capitals."""
    if f.metadata.get("positional"):
        return f.name.upper()
    return field_flag(f).split("/")[0]


def _flat_fields(classes: tuple[type, ...]) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every field that becomes a flag, by name: a class's own fields before inherited ones."""
    flat: dict[str, tuple[dataclasses.Field, Any]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        own = cls.__dict__.get("__annotations__", {})
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
            if dataclasses.is_dataclass(hints[f.name]):
                nested = _flat_fields((hints[f.name],))
            else:
                nested = {f.name: (f, hints[f.name])}
            for key, value in nested.items():
                if key in flat:  # one flag, one meaning
                    raise TypeError(f"option {key!r} is defined twice for one command")
                flat[key] = value
    return flat


def _optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` → (X, True); anything else → (hint, False)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _annotation(hint: Any) -> Any:
    """The type typer parses the flag as: tuples arrive as comma-separated text."""
    inner, optional = _optional(hint)
    if typing.get_origin(inner) is tuple:
        inner = str
    return inner | None if optional else inner


def _parameter(f: dataclasses.Field, hint: Any, loose: bool) -> Any:
    """The ``typer.Option`` (or ``typer.Argument``) for one field."""
    meta = f.metadata
    inner, _ = _optional(hint)
    parse = _tuple_parser(inner, field_flag(f), meta.get("check")) if typing.get_origin(inner) is tuple else None
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    default: Any = ... if f.default is dataclasses.MISSING else f.default
    if default is ... and loose and factory is None:
        default = None
    if parse is not None and isinstance(default, tuple):
        default = ",".join(str(item) for item in default)  # shown and parsed like a typed value
    check = meta.get("check")
    text = meta.get("help") or None
    if text and check is not None and check.shown:
        text = f"{text} ({check.summary})"
    if meta.get("positional"):
        return typer.Argument(default, help=text)
    return typer.Option(default, field_flag(f), help=text, callback=parse,
                        default_factory=factory, show_default=factory is None)  # a computed default: the help says it


def _tuple_parser(kind: Any, flag: str, check: Any = None) -> Callable:
    """A typer callback turning ``"2,15,27"`` (or ``"[2, 15, 27]"``) into a tuple of the annotated item type. Text that
    is none (empty, an item of another type, a count other than a fixed tuple's) is an EyasError naming the flag and
    what it takes (with the field's ``check`` where its help shows it): one ``error:`` line at the command line's
    boundary, as a value the check refuses is, not click's usage box."""
    args = typing.get_args(kind)
    fixed = bool(args) and args[-1] is not Ellipsis
    item = args[0] if args else str
    spelled = flag.split("/")[0]

    def parse(value):
        if value is None or isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).strip().strip("[]()").split(",") if p.strip()]
        try:
            items = tuple((args[i] if fixed else item)(p) for i, p in enumerate(parts))
        except (ValueError, IndexError):
            items = None
        if not items or (fixed and len(items) != len(args)):
            count = len(args) if fixed else "one or more"
            rule = f" ({check.summary})" if check is not None and check.shown else ""
            raise EyasError(f"{spelled} {value!r}: expected {count} comma-separated {item.__name__} values{rule}")
        return items

    return parse
