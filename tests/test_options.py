"""Options defined once: the command line, run configs and Python see the same fields and defaults."""

from __future__ import annotations

import dataclasses
import typing
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from eyas import options as command_options
from eyas.cli import app
from eyas.config import load_config
from eyas.demo import demo_config
from eyas.flags import command
from eyas.stages import STAGES

SRC = Path(__file__).resolve().parents[1] / "src"

# The fewest flags each stage command runs with, and the same values as Python keywords.
REQUIRED = {
    "prepare": (["--target", "demo", "--data", "chats.jsonl", "--out", "d"], dict(target="demo", data=["chats.jsonl"], out=Path("d"))),
    "capture": (["--target", "demo", "--data", "d", "--out", "f"], dict(target="demo", data=Path("d"), out=Path("f"))),
    "train": (["--target", "demo", "--out", "r"], dict(target="demo", out=Path("r"))),
    "export": (["r", "--out", "x"], dict(run_dir=Path("r"), out=Path("x"))),
    "bench": (["--target", "demo", "--draft", "x", "--out", "b"], dict(target="demo", draft=Path("x"), out=Path("b"))),
}


def _parsed_by_the_cli(monkeypatch, stage: str, args: list[str]):
    """The options object `eyas STAGE ARGS` hands to the stage (the stage itself replaced by a recorder)."""
    seen = []
    monkeypatch.setitem(STAGES, stage, dataclasses.replace(STAGES[stage], run=lambda options, console: seen.append(options)))
    result = CliRunner().invoke(app, [stage, *args])
    assert result.exit_code == 0, result.output
    (options,) = seen
    return options


@pytest.mark.parametrize("stage", list(STAGES))
def test_each_stage_default_is_the_same_through_the_cli_a_run_config_and_python(monkeypatch, tmp_path, stage):
    args, required = REQUIRED[stage]
    cli = _parsed_by_the_cli(monkeypatch, stage, args)
    toml = tmp_path / "run.toml"
    toml.write_text(f'target = "demo"\nworkdir = "{tmp_path / "w"}"\nstages = ["{stage}"]\n[prepare]\ndata = ["chats.jsonl"]\n')
    config = load_config(toml)
    from_file, wired = config.options(stage), config.wired(stage)
    python = STAGES[stage].options(**required)
    for f in dataclasses.fields(python):
        assert getattr(cli, f.name) == getattr(python, f.name), f"eyas {stage} --{f.name}: the CLI's default differs"
        if f.name not in wired:
            assert getattr(from_file, f.name) == getattr(python, f.name), f"[{stage}] {f.name}: eyas run's default differs"


def test_prepare_uses_every_visible_gpu_unless_workers_is_given(monkeypatch, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f'target = "demo"\nworkdir = "{tmp_path}"\n[prepare]\ndata = ["sharegpt"]\n')
    assert load_config(toml).options("prepare").workers is None
    assert _parsed_by_the_cli(monkeypatch, "prepare", REQUIRED["prepare"][0]).workers is None
    assert _parsed_by_the_cli(monkeypatch, "prepare", [*REQUIRED["prepare"][0], "--workers", "2"]).workers == 2


def _non_stage_classes() -> list[type]:
    return [cls for cls in vars(command_options).values()
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__name__.endswith("Options")]


@pytest.mark.parametrize("cls", [stage.options for stage in STAGES.values()] + _non_stage_classes(), ids=lambda c: c.__name__)
def test_every_options_class_read_with_only_its_required_flags_equals_its_own_defaults(cls):
    fields = [f for f in dataclasses.fields(cls)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    args, values, hints = [], {}, typing.get_type_hints(cls)
    for f in fields:  # a required value of the field's type, spelled as the command line takes it
        value = ["a.jsonl"] if hints[f.name] == list[str] else Path("p") if hints[f.name] is Path else "v"
        values[f.name] = value
        text = str(value[0] if isinstance(value, list) else value)
        args += [text] if f.metadata["positional"] else [f.metadata["flag"] or "--" + f.name.replace("_", "-"), text]
    seen = []
    probe = typer.Typer()
    command(probe, cls, name="probe")(seen.append)
    probe.command("other")(lambda: None)  # two commands: typer then keeps the command's name
    result = CliRunner().invoke(probe, ["probe", *args])
    assert result.exit_code == 0, result.output
    assert seen == [cls(**values)]


def test_every_option_has_help():
    classes = [stage.options for stage in STAGES.values()] + _non_stage_classes()
    classes.append(STAGES["prepare"].options.__dataclass_fields__["regeneration"].default_factory)
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help") or f.name == "regeneration", f"{cls.__name__}.{f.name} has no help text"


@pytest.mark.parametrize("flags, expected", [
    (["--layer-ids", "2,15,27"], dict(layer_ids=(2, 15, 27))),
    (["--layer-ids", "[2, 4, 8]"], dict(layer_ids=(2, 4, 8))),
    (["--splits", "holdout", "--max-gb", "1.5"], dict(splits=("holdout",), max_gb=1.5)),
])
def test_a_tuple_is_one_comma_separated_flag(monkeypatch, flags, expected):
    options = _parsed_by_the_cli(monkeypatch, "capture", [*REQUIRED["capture"][0], *flags])
    assert {key: getattr(options, key) for key in expected} == expected


@pytest.mark.parametrize("command_line, message", [
    (["capture", "--target", "t", "--data", "d", "--out", "o", "--layer-ids", "two"], "--layer-ids"),
    (["train", "--target", "t", "--out", "o", "--betas", "0.9"], "expected 2 comma-separated float values"),
])
def test_a_bad_tuple_flag_is_a_usage_error(command_line, message):
    result = CliRunner().invoke(app, command_line)
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_stable_command_line_of_design_md_is_accepted():
    commands = typer.main.get_command(app).commands
    stable = {  # DESIGN.md's command list: arguments by name, flags as spelled there
        "inspect": ["target"], "prepare": ["--target", "--data", "--out"], "capture": ["--target", "--data", "--out"],
        "train": ["--target", "--features", "--data", "--online", "--stream", "--stream-listen", "--out", "--resume"],
        "produce": ["--trainer", "--target", "--data", "--engine"],
        "export": ["run_dir", "--out", "--format"], "check": ["draft_dir"],
        "bench": ["--target", "--draft", "--dataset", "--out", "--mode"],
        "generate": ["--target", "--draft", "--max-new-tokens", "--temperature", "--json", "prompt"],
        "run": ["config"], "demo": [],
    }
    assert set(commands) == set(stable)
    for name, spelled in stable.items():
        accepted = {spelling for param in commands[name].params for spelling in [param.name, *param.opts]}
        assert set(spelled) <= accepted, f"eyas {name} lost {set(spelled) - accepted}"
    assert "--data" in {o for p in commands["prepare"].params if p.multiple for o in p.opts}  # repeatable


def test_config_and_cli_import_without_torch():
    code = ("import sys, json, eyas.config, eyas.cli, eyas.pipeline, eyas.stages; "
            "print(json.dumps(sorted(m for m in ('torch', 'numpy', 'pyarrow', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert json.loads(out.stdout) == []


def test_eyas_run_runs_the_table_in_pipeline_order_and_hands_each_stage_the_folder_before(monkeypatch, tmp_path):
    ran = []
    for name, stage in STAGES.items():  # no up-front check: target 't' has no config to read
        record = lambda options, console, name=name: ran.append((name, options))  # noqa: E731
        monkeypatch.setitem(STAGES, name, dataclasses.replace(stage, run=record, check=None))
    toml = tmp_path / "run.toml"
    toml.write_text(f'target = "t"\nworkdir = "{tmp_path / "w"}"\nstages = ["bench", "export", "train", "prepare"]\n'
                    '[prepare]\ndata = ["x.jsonl"]\n[train]\nlr = 0.5\n')
    result = CliRunner().invoke(app, ["run", str(toml), "--set", "train.ttt_steps=2"])
    assert result.exit_code == 0, result.output
    assert [name for name, _ in ran] == ["prepare", "train", "export", "bench"]
    prepare, train, export, bench = (options for _, options in ran)
    work = tmp_path / "w"
    assert (prepare.target, prepare.out, prepare.data) == ("t", work / "data", ["x.jsonl"])
    assert (train.data, train.out, train.online, train.features, train.resume) == (work / "data", work / "run", True, None, True)
    assert (train.lr, train.ttt_steps) == (0.5, 2)  # the file, then --set
    assert (export.run_dir, export.out) == (work / "run", work / "draft")
    assert (bench.draft, bench.out, bench.data) == (work / "draft", work / "bench", None)  # prepare wrote no DATA_DIR here


def test_with_a_capture_stage_training_reads_the_features(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f'target = "t"\nworkdir = "{tmp_path}"\nstages = ["prepare", "capture", "train"]\n[prepare]\ndata = ["x"]\n')
    train = load_config(toml).options("train")
    assert (train.online, train.features) == (False, tmp_path / "features")


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_the_demo_config_builds_every_stage(tmp_path, quick):
    config = demo_config(tmp_path, quick)
    assert config.stages == tuple(STAGES)
    built = {stage: config.options(stage) for stage in config.stages}
    assert built["train"].online and built["train"].checkpoint_every == built["train"].max_steps
    assert built["bench"].device == "cpu" and built["bench"].data is None  # DATA_DIR once prepare has written it


def test_capture_needs_its_paths_unless_it_checks_a_store():
    result = CliRunner().invoke(app, ["capture", "--target", "demo"])
    assert result.exit_code == 2 and "needs --target, --data and --out (or --check FEATURES_DIR)" in result.output
