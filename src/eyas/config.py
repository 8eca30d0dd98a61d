"""Run configs: one TOML file names the target and each stage's options (``eyas run CONFIG.toml``).

Each section is a stage's options dataclass (``eyas.stages.STAGES``: PrepareOptions, CaptureOptions,
TrainOptions, ExportOptions, BenchOptions), whose fields also give the stage's flags and defaults; a
config only says what differs. Precedence: ``--set section.key=value`` over the file over those
defaults. Paths between stages (DATA_DIR, FEATURES_DIR, RUN_DIR, DRAFT_DIR, REPORT_DIR) are not
configured per stage: they are ``workdir``'s subfolders, so the stages always read what the one
before wrote.

A mistake names the file, the key and what was expected, and suggests the nearest known key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (a dependency there)
    import tomli as tomllib

from eyas.errors import EyasError
from eyas.options import field_problem
from eyas.stages import STAGES


class ConfigError(EyasError):
    """A config file (or --set override) that cannot be used as written."""


@dataclass
class RunConfig:
    """A whole pipeline: the target, where it writes, which stages run, and each stage's options."""

    target: str
    workdir: Path
    stages: tuple[str, ...]
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # checked keys → values, per stage
    source: str = "<config>"

    def folder(self, stage: str) -> Path:
        """The directory ``stage`` writes (and the next stage reads)."""
        return self.workdir / STAGES[stage].folder

    def wired(self, stage: str) -> dict[str, Any]:
        """The options eyas run sets itself: the target, the folders the stages hand on, and three rules."""
        sources = {"target": self.target, "out": self.folder(stage), "data": self.folder("prepare"),
                   "features": self.folder("capture"), "run_dir": self.folder("train"), "draft": self.folder("export"),
                   "resume": True}  # a rerun continues training where it stopped
        values = {name: sources[name] for name in STAGES[stage].wired}
        train = self.sections.get("train", {})
        if stage == "train" and "online" not in train:
            values["online"] = "capture" not in self.stages  # no capture stage: no features to train from
        if stage == "train" and train.get("online", values.get("online")):
            del values["features"]
        if stage == "bench" and not (values["data"] / "manifest.json").is_file():
            values["data"] = None  # only a DATA_DIR that prepare finished
        template = self.sections.get("prepare", {}).get("chat_template")
        if stage == "bench" and template and "chat_template" not in self.sections.get("bench", {}):
            values["chat_template"] = template  # benchmark prompts rendered as the training data was
        return values

    def options(self, stage: str):
        """The stage's options: its defaults, then this config's values, then what eyas run wires; an option the stage
        requires that neither gives is refused, naming the section."""
        values = {**self.wired(stage), **self.sections.get(stage, {})}
        missing = [f.name for f in dataclasses.fields(STAGES[stage].options) if f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{self.source} [{stage}]: {', '.join(repr(name) for name in missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} required by the {stage} stage: add "
                              f"{'it' if len(missing) == 1 else 'them'} to [{stage}] (or leave {stage} out of 'stages')")
        return STAGES[stage].options(**values)


def load_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read ``path`` (TOML), apply ``section.key=value`` overrides, check every key and type."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}): not a TOML run config; give "
                          "a TOML file (see examples/*.toml)") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    return build_config(raw, str(path), overrides)


def build_config(raw: dict, source: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A config from TOML-shaped tables (a parsed file, or a built-in one), with overrides; every key checked."""
    raw = copy.deepcopy(raw)  # overrides write into the tables
    for override in overrides:
        _apply_override(raw, override)
    known_top = {"target", "workdir", "stages", *STAGES}
    for key in raw:
        if key not in known_top:
            raise ConfigError(f"{source}: unknown key {key!r}{_suggest(key, known_top)}")
    if not isinstance(raw.get("target"), str) or not raw["target"]:
        raise ConfigError(f"{source}: 'target' is required: a hub id, an HF directory, a .gguf file or 'demo'")
    workdir = raw.get("workdir")
    if not isinstance(workdir, str) or not workdir:
        raise ConfigError(f"{source}: 'workdir' is required: the folder the stages write into (data/, run/, draft/, ...)")
    stages = raw.get("stages", ["prepare", "train", "export", "bench"])
    if not isinstance(stages, list) or not all(isinstance(s, str) for s in stages):
        raise ConfigError(f"{source}: 'stages' is a list of stage names, e.g. [\"prepare\", \"train\", \"export\", \"bench\"]")
    for stage in stages:
        if stage not in STAGES:
            raise ConfigError(f"{source}: unknown stage {stage!r} in 'stages'{_suggest(stage, STAGES)}")
    sections = {}
    for name, stage in STAGES.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of options")
        sections[name] = _check_table(table, stage.options, f"{source} [{name}]", stage.wired)
    _check_drafter_options(sections["train"], f"{source} [train]")
    ordered = tuple(s for s in STAGES if s in stages)  # stages always run in pipeline order
    return RunConfig(target=raw["target"], workdir=Path(workdir).expanduser(), stages=ordered, sections=sections,
                     source=source)


def select_stages(config: RunConfig, chosen: tuple[str, ...] | None) -> RunConfig:
    """``config`` with only the ``chosen`` stages (``eyas run --stages``; None keeps them all), in pipeline order."""
    if not chosen:
        return config
    unknown = [s for s in chosen if s not in config.stages]
    if unknown:
        raise ConfigError(f"--stages {','.join(chosen)}: {', '.join(unknown)} not among the config's stages "
                          f"({', '.join(config.stages)})")
    return dataclasses.replace(config, stages=tuple(s for s in config.stages if s in chosen))


def _check_table(table: dict, cls: type, where: str, wired: set[str] = frozenset()) -> dict[str, Any]:
    """Each key a field of ``cls`` (not a wired one), each value converted to the field's type and passing its check."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in wired}
    checked = {}
    for key, value in table.items():
        if key in wired:
            raise ConfigError(f"{where}: {key!r} is set by eyas run from 'target' and 'workdir'; remove it")
        if key not in fields:
            raise ConfigError(f"{where}: unknown option {key!r}{_suggest(key, fields)}")
        checked[key] = _convert(value, hints[key], f"{where} {key}")
        rule = field_problem(fields[key], checked[key])
        if rule is not None:
            raise ConfigError(f"{where} {key} = {value!r}: {rule}")
    return checked


def _check_drafter_options(train: dict[str, Any], where: str) -> None:
    """Refuse a [train] option that only drafter families other than the section's ``drafter`` read (it would be
    ignored): the rule eyas train applies to its flags (:func:`eyas.families.unread_refusal`), spelled as the config's
    keys."""
    from eyas import families

    refusal = families.unread_refusal(train.get("drafter", families.DEFAULT), train, lambda f: f.name,
                                      lambda name: f'drafter = "{name}"')
    if refusal:
        raise ConfigError(f"{where}: {refusal}")


def _convert(value: Any, kind: Any, where: str) -> Any:
    """``value`` (as TOML gives it) as an instance of the annotated type ``kind``, or a ConfigError."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            if type(None) in args:
                return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: got {value!r}")
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return kind(**_check_table(value, kind, where))
    if origin in (tuple, list):
        if origin is tuple and args and args[-1] is Ellipsis and not isinstance(value, list | dict):
            value = [value]  # one value for a tuple of any length: a tuple of one (temperature = 0.0)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(_convert(v, a, where) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        converted = [_convert(v, item, where) for v in value]
        return tuple(converted) if origin is tuple else converted
    if kind is Any:
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected a whole number, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if kind is Path:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a path (a string), got {value!r}")
        return Path(value).expanduser()
    raise ConfigError(f"{where}: options of type {kind} cannot be set from a config")


def _apply_override(raw: dict, override: str) -> None:
    """``section.key=value`` (value in TOML syntax; a bare word is a string) into the raw tables."""
    dotted, sep, text = override.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError(f"--set {override!r}: expected section.key=value, e.g. train.lr=1e-4")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # e.g. --set target=demo: a bare word is meant as a string
    table = raw
    *parents, last = [part.strip() for part in dotted.split(".")]
    for part in parents:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {override!r}: {part!r} is not a table")
    table[last] = value


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(sorted(known))}"


def spelled_for_run(message: str, stage: str) -> str:
    """A stage's message as ``eyas run`` reads it: a boolean flag of that stage (``--force``, ``--no-verify``)
    becomes the override that sets it (``--set train.force=true``), since eyas run takes no stage flags."""
    from eyas.options import field_flag

    for f in dataclasses.fields(STAGES[stage].options):
        if f.type not in (bool, "bool"):
            continue
        yes, _, no = field_flag(f).partition("/")
        for flag, value in ((yes, "true"), (no, "false")):
            if flag:
                message = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", f"--set {stage}.{f.name}={value}", message)
    return message
