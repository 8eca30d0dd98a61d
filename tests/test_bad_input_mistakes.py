"""Ordinary mistakes end in one line and exit 2, never a traceback, and write nothing.

The command line's one error boundary (user errors → one line; bugs keep their traceback; --debug), option
ranges defined once with the option and refused alike by the CLI, a run config and Python, decoding modes the
caches cannot hold or the drafter cannot draft, an empty holdout, a finished run resumed, help on every option.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import typing
from pathlib import Path

import pytest
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

import zoo
from eyas import options as command_options
from eyas.bench.options import BenchOptions
from eyas.cli import app
from eyas.data.options import PrepareOptions, RegenerationOptions
from eyas.engine.modes import DRAFTER_SPARE, drafter_spare, parse_modes
from eyas.errors import EyasError, OptionError
from eyas.options import GenerateOptions
from eyas.stages import STAGES
from eyas.train.options import TrainOptions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target, a DATA_DIR (with and without holdout samples) and a random drafter for it."""
    from eyas.families.eagle3.export import draft_config, draft_tensors
    from eyas.export.files import write_draft_dir
    from test_drafter_consistency import random_drafter, tiny_config
    from test_import_layouts import weights

    root = tmp_path_factory.mktemp("mistakes")
    target = zoo.save_tiny_target(root / "target")
    zoo.write_data_dir(root / "data", sizes=(("train", 6), ("holdout", 3)))
    zoo.write_data_dir(root / "no-holdout", sizes=(("train", 6), ("holdout", 0)))
    drafter = random_drafter(tiny_config(vocab_size=zoo.VOCAB, draft_vocab_size=100))
    config = draft_config(drafter.config, "llama", zoo.LAYERS, "fp32")
    write_draft_dir(root / "draft", config, draft_tensors(weights(drafter), config, "fp32"), "")
    return root, target


def invoke(args: list[str], **kwargs):
    return CliRunner().invoke(app, args, terminal_width=400, **kwargs)


def one_line_error(result, *named: str) -> str:
    """The run exited 2 with one `error:` line naming each of ``named``, and no traceback."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # exited, did not crash
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and len(errors[0].splitlines()) == 1, result.output
    for name in named:
        assert name in errors[0], (name, errors[0])
    return errors[0]


# ---------------------------------------------------------------- 1. the error boundary

# every command, and the function inside it that a failure comes from
COMMANDS = {
    "inspect": (["inspect", "demo"], "eyas.target.describe", "describe_target"),
    "prepare": (["prepare", "--target", "t", "--data", "d", "--out", "o"], None, "prepare"),
    "capture": (["capture", "--target", "t", "--data", "d", "--out", "o"], None, "capture"),
    "capture --check": (["capture", "--check", "f"], "eyas.store.check", "check_store"),
    "train": (["train", "--target", "t", "--out", "o"], None, "train"),
    "produce": (["produce", "--trainer", "h:1", "--target", "t", "--data", "d"], "eyas.train.stream.remote", "produce"),
    "export": (["export", "r", "--out", "o"], None, "export"),
    "check": (["check", "d"], "eyas.export.check", "check_for_target"),
    "bench": (["bench", "--target", "t", "--draft", "d", "--out", "o"], None, "bench"),
    "generate": (["generate", "hi", "--target", "t"], "eyas.target.loading", "load_target"),
    "run": (["run", "c.toml"], "eyas.config", "load_config"),
    "demo": (["demo"], "eyas.demo", "run_demo"),
}
FAILURES = {  # what a user can cause → words its one line must hold
    "EyasError": (EyasError("DATA_DIR /x has no train.parquet:\n  run eyas prepare first"), ["/x", "eyas prepare"]),
    "ENOSPC": (OSError(errno.ENOSPC, "No space left on device"), ["no space left", "free some space"]),
    "EACCES": (PermissionError(errno.EACCES, "Permission denied", "/data/run"), ["/data/run", "permission denied"]),
    "EROFS": (OSError(errno.EROFS, "Read-only file system", "/ro/out"), ["/ro/out", "read-only", "writable"]),
    "ENOENT": (FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such"), ["/no/such", "check the path"]),
    "EISDIR": (IsADirectoryError(errno.EISDIR, "Is a directory", "/a/dir"), ["/a/dir", "is a directory"]),
    "ENOTDIR": (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/f/x"), ["/f/x", "not a directory"]),
}


def _fail_inside(monkeypatch, command: str, error: BaseException) -> None:
    """Make ``command`` raise ``error`` from inside its work."""
    _, module, name = COMMANDS[command]

    def raising(*args, **kwargs):
        raise error

    if module is None:  # a stage: its row of the stage table
        monkeypatch.setitem(STAGES, name, dataclasses.replace(STAGES[name], run=raising))
    else:
        monkeypatch.setattr(f"{module}.{name}", raising)


def test_the_boundary_table_covers_every_command():
    assert {args[0] for args, _, _ in COMMANDS.values()} == set(typer.main.get_command(app).commands)


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_user_error_in_any_command_is_one_line_and_exit_2(monkeypatch, command, failure):
    error, words = FAILURES[failure]
    _fail_inside(monkeypatch, command, error)
    one_line_error(invoke(COMMANDS[command][0]), *words)


@pytest.mark.parametrize("error", [RuntimeError("a bug in eyas"), KeyError("layers"),
                                   OSError(errno.ECONNREFUSED, "Connection refused"),  # not about a user's path
                                   OSError(errno.ENOENT, "No such file or directory")],  # no path named: eyas' own
                         ids=["RuntimeError", "KeyError", "ECONNREFUSED", "ENOENT-without-a-path"])
def test_a_bug_keeps_its_traceback(monkeypatch, error):
    _fail_inside(monkeypatch, "train", error)
    result = invoke(COMMANDS["train"][0])
    assert result.exception is error and result.exit_code == 1  # raised through: Python prints its traceback
    assert "error:" not in result.output


def test_a_real_os_error_names_the_path(tmp_path):
    one_line_error(invoke(["run", str(tmp_path)]), str(tmp_path), "is a directory")  # a directory as CONFIG
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_line_error(invoke(["run", str(blocker / "run.toml")]), str(blocker), "not a directory")


@pytest.mark.parametrize("how", ["--debug", "EYAS_DEBUG=1"])
def test_debug_shows_the_traceback_of_a_user_error(tmp_path, how):
    args, env = (["--debug"], {}) if how == "--debug" else ([], {"EYAS_DEBUG": "1"})
    result = invoke([*args, "run", str(tmp_path)], env=env)
    assert result.exit_code == 2 and "Traceback" in result.output and "IsADirectoryError" in result.output
    assert f"error: {tmp_path}: is a directory" in result.output
    assert "Traceback" not in invoke(["run", str(tmp_path)], env={"EYAS_DEBUG": "0"}).output


@pytest.mark.parametrize(("args", "named"), [
    (["train", "--target", "t", "--out", "o", "--max-steps", "many"], ["'--max-steps'", "eyas train --help"]),
    (["train", "--target", "t", "--out", "o", "--lrr", "1"], ["No such option: --lrr", "--lr"]),
    (["bench", "--target", "t", "--out", "o", "--max-new-tokens", "1e3x"], ["'--max-new-tokens'", "eyas bench --help"]),
    (["train", "--out", "o"], ["Missing option '--target'"]),
    (["generate"], ["Missing argument"]),
    (["trian"], ["No such command 'trian'", "'train'"]),
], ids=["type", "unknown-flag", "bench-type", "missing-option", "missing-argument", "unknown-command"])
def test_a_command_line_click_cannot_parse_is_one_error_line_not_a_usage_box(tmp_path, args, named):
    result = invoke(args)
    line = one_line_error(result, *named)
    assert "Usage:" not in result.output and "╭" not in result.output and line.endswith("lists what it takes)")
    assert not (tmp_path / "o").exists() and not Path("o").exists()


# ---------------------------------------------------------------- 2. option ranges, defined once

OUT = "OUT"  # replaced by a path under tmp_path: it must still not exist afterwards
COMMAND_LINES = {  # each command with its required arguments
    "train": ["train", "--target", "t", "--out", OUT],
    "prepare": ["prepare", "--target", "t", "--data", "d", "--out", OUT],
    "capture": ["capture", "--target", "t", "--data", "d", "--out", OUT],
    "capture --check": ["capture", "--check", OUT],
    "bench": ["bench", "--target", "t", "--draft", "d", "--out", OUT],
    "generate": ["generate", "hi", "--target", "t"],
}
BAD_FLAGS = [  # (command, the bad flag and value, how the message names them, the range it gives)
    ("prepare", ["--server", "notaurl"], "--server notaurl", "an http:// or https:// URL"),  # was a ValueError
    ("bench", ["--server", "ftp://x"], "--server ftp://x", "an http:// or https:// URL"),
    ("train", ["--ttt-steps", "0"], "--ttt-steps 0", "≥ 1"),
    ("train", ["--lr", "-1"], "--lr -1.0", "> 0"),
    ("train", ["--lr", "0"], "--lr 0.0", "> 0"),
    ("train", ["--epochs", "-2"], "--epochs -2.0", "> 0"),
    ("train", ["--max-steps", "-1"], "--max-steps -1", "≥ 1"),
    ("train", ["--token-budget", "0"], "--token-budget 0", "≥ 1"),
    ("train", ["--grad-accum", "0"], "--grad-accum 0", "≥ 1"),
    ("train", ["--warmup-ratio", "1.5"], "--warmup-ratio 1.5", "in [0, 1]"),
    ("train", ["--step-decay", "0"], "--step-decay 0.0", "in (0, 1]"),
    ("train", ["--betas", "0.9,1.0"], "--betas 0.9,1.0", "each must be in [0, 1)"),
    ("train", ["--keep", "0"], "--keep 0", "≥ 1"),
    ("train", ["--seed", "-1"], "--seed -1", "in [0, 4294967295]"),
    ("prepare", ["--limit", "0"], "--limit 0", "≥ 1"),
    ("prepare", ["--holdout", "1"], "--holdout 1.0", "in [0, 1)"),
    ("prepare", ["--max-length", "1"], "--max-length 1", "≥ 2"),
    ("prepare", ["--workers", "-1"], "--workers -1", "≥ 1"),
    ("prepare", ["--on-overflow", "cut"], "--on-overflow cut", "one of truncate, drop"),
    ("prepare", ["--concurrency", "0"], "--concurrency 0", "≥ 1"),
    ("prepare", ["--timeout", "0"], "--timeout 0.0", "> 0"),
    ("capture", ["--token-budget", "-5"], "--token-budget -5", "≥ 1"),
    ("capture", ["--max-gb", "0"], "--max-gb 0.0", "> 0"),
    ("capture", ["--layer-ids", "-1,2,3"], "--layer-ids -1,2,3", "each must be ≥ 0"),
    ("capture", ["--engine", "sglang"], "--engine sglang", "one of hf, vllm"),
    ("capture --check", ["--check-samples", "-1"], "--check-samples -1", "≥ 0"),
    ("bench", ["--prompts", "0"], "--prompts 0", "≥ 1"),
    ("bench", ["--temperature", "-1"], "--temperature -1.0", "≥ 0"),
    ("bench", ["--top-p", "0"], "--top-p 0.0", "in (0, 1]"),
    ("bench", ["--top-p", "1.5"], "--top-p 1.5", "in (0, 1]"),
    ("bench", ["--dataset", "mt-bench,gsm8k"], "--dataset mt-bench,gsm8k", "each must be one of mt-bench, humaneval, sharegpt-holdout"),
    ("bench", ["--mode", "chain:0"], "--mode chain:0", "chain:K"),
    ("bench", ["--mode", "chain:5,beam:3"], "--mode chain:5,beam:3", "tree:TOTAL"),
    ("generate", ["--temperature", "-1"], "--temperature -1.0", "≥ 0"),
    ("generate", ["--top-p", "0"], "--top-p 0.0", "in (0, 1]"),
    ("generate", ["--max-new-tokens", "0"], "--max-new-tokens 0", "≥ 1"),
    ("generate", ["--mode", "tree:60,7"], "--mode tree:60,7", "tree:TOTAL,DEPTH,TOPK"),
    ("generate", ["--device", "gpu"], "--device gpu", "cpu, cuda or cuda:N"),
]


@pytest.mark.parametrize("command, flag, named, rule", BAD_FLAGS, ids=[named for _, _, named, _ in BAD_FLAGS])
def test_an_option_out_of_range_on_the_command_line_is_refused_before_any_work(monkeypatch, tmp_path, command, flag, named,
                                                                                rule):
    ran = []
    for name, stage in STAGES.items():
        monkeypatch.setitem(STAGES, name, dataclasses.replace(stage, run=lambda *a: ran.append(a)))
    out = tmp_path / "out"
    one_line_error(invoke([str(out) if a == OUT else a for a in [*COMMAND_LINES[command], *flag]]), named, rule)
    assert not ran and not out.exists() and list(tmp_path.iterdir()) == []


BAD_CONFIGS = [  # (the config's own lines or an override, what the one line names)
    ("[train]\nttt_steps = 0\n", (), ["[train] ttt_steps = 0", "≥ 1"]),
    ("[train]\nlr = -1e-4\n", (), ["[train] lr = -0.0001", "> 0"]),
    ("[prepare]\ndata = ['x']\nlimit = 0\n", (), ["[prepare] limit = 0", "≥ 1"]),
    ("[prepare]\ndata = ['x']\n[prepare.regeneration]\ntimeout = 0\n", (), ["[prepare] regeneration timeout = 0", "> 0"]),
    ("[bench]\ntop_p = 1.5\n", (), ["[bench] top_p = 1.5", "in (0, 1]"]),
    ("[capture]\nengine = 'sglang'\n", (), ["[capture] engine = 'sglang'", "one of hf, vllm"]),
    ("[bench]\nmodes = 'tree:1'\n", (), ["[bench] modes = 'tree:1'", "chain:K"]),
    ("", ("train.epochs=0",), ["[train] epochs = 0", "> 0"]),
]


@pytest.mark.parametrize("lines, overrides, named", BAD_CONFIGS, ids=[n[0] for _, _, n in BAD_CONFIGS])
def test_an_option_out_of_range_in_a_run_config_names_the_file_and_section(tmp_path, lines, overrides, named):
    config = tmp_path / "run.toml"
    config.write_text(f'target = "t"\nworkdir = "{tmp_path / "work"}"\n{lines}')
    sets = [arg for override in overrides for arg in ("--set", override)]
    one_line_error(invoke(["run", str(config), *sets]), str(config), *named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # no workdir


@pytest.mark.parametrize("build, name", [
    (lambda: TrainOptions(target="t", out=Path("o"), ttt_steps=0), "ttt_steps"),
    (lambda: TrainOptions(target="t", out=Path("o"), lr=-1.0), "lr"),
    (lambda: PrepareOptions(target="t", data=["d"], out=Path("o"), limit=0), "limit"),
    (lambda: RegenerationOptions(concurrency=0), "concurrency"),
    (lambda: GenerateOptions(prompt="hi", target="t", top_p=0.0), "top_p"),
    (lambda: BenchOptions(target="t", draft=Path("d"), out=Path("o"), modes="chain:0"), "modes"),
    (lambda: dataclasses.replace(TrainOptions(target="t", out=Path("o")), epochs=0.0), "epochs"),
], ids=["ttt_steps", "lr", "limit", "concurrency", "top_p", "modes", "replace"])
def test_an_option_out_of_range_from_python_is_refused_when_the_options_are_built(build, name):
    with pytest.raises(OptionError, match=f"\\.{name} = .*: .*must be") as refused:
        build()
    assert refused.value.name == name


def test_the_ends_of_each_range_that_belong_to_it_pass():
    GenerateOptions(prompt="hi", target="t", temperature=0.0, top_p=1.0, max_new_tokens=1, seed=0, device="cuda:1")
    TrainOptions(target="t", out=Path("o"), warmup_ratio=1.0, step_decay=1.0, betas=(0.0, 0.999), seed=2**32 - 1)
    PrepareOptions(target="t", data=["d"], out=Path("o"), holdout=0.0, max_length=2, limit=1)


def _option_classes() -> list[type]:
    classes = {stage.options for stage in STAGES.values()} | {RegenerationOptions}
    classes |= {cls for cls in vars(command_options).values()
                if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__name__.endswith("Options")}
    from eyas.capture.options import StoreCheckOptions

    return sorted(classes | {StoreCheckOptions}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _option_classes(), ids=lambda c: c.__name__)
def test_every_numeric_option_has_a_range(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kinds = set(typing.get_args(hints[f.name])) | {hints[f.name]}
        numeric = any(kind in (int, float) for kind in kinds) or any(
            set(typing.get_args(kind)) & {int, float} for kind in kinds if typing.get_origin(kind) is tuple)
        if numeric:
            assert f.metadata.get("check") is not None, f"{cls.__name__}.{f.name} has no range: option(check=...)"


# ---------------------------------------------------------------- 3. modes, an empty holdout, a finished run resumed

def _bench(tiny, out: Path, mode: str) -> list[str]:
    root, target = tiny
    return ["bench", "--target", target, "--draft", str(root / "draft"), "--out", str(out), "--dataset", "sharegpt-holdout",
            "--data", str(root / "data"), "--mode", mode, "--prompts", "1", "--max-new-tokens", "8", "--device", "cpu",
            "--temperature", "0", "--dtype", "fp32"]  # fp32: greedy speculation equals plain token for token


@pytest.mark.parametrize("mode, named", [
    ("tree:4,20,10", ["--mode tree:4,20,10", "DEPTH 20 is more than TOTAL 4"]),  # was an IndexError in the target cache
    ("tree:8,3,200", ["--mode tree:8,3,200", "TOPK 200", "100-token vocabulary", "draft"]),  # was torch.topk's error
])
def test_a_tree_the_engine_cannot_decode_is_refused(tiny, tmp_path, mode, named):
    one_line_error(invoke(_bench(tiny, tmp_path / "report", mode)), *named)
    assert not (tmp_path / "report").exists()


def test_long_chains_and_wide_trees_fit_the_caches_bench_sizes(tiny, tmp_path):
    """These modes write more drafter slots a round than the target's: they used to stop with "the sequence needs
    more than the N cache slots" — the drafter's cache is now sized to the modes (the defaults' stay as they were)."""
    result = invoke(_bench(tiny, tmp_path / "report", "chain:21,tree:8,4,8"))
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["rows"]
    assert {row["mode"] for row in rows} == {"chain:21", "tree:8,4,8"}
    assert all(row["matches_plain"] == row["prompts"] == 1 for row in rows)  # greedy: the same tokens as plain
    assert drafter_spare(parse_modes("chain:5,tree:60,7,10")) == DRAFTER_SPARE  # the default modes' caches: unchanged


def _train(tiny, data: str, out: Path, *extra: str) -> list[str]:
    root, target = tiny
    return ["train", "--target", target, "--data", str(root / data), "--out", str(out), "--max-steps", "2", "--ttt-steps", "1",
            "--token-budget", "256", "--checkpoint-every", "2", *extra]


def test_an_empty_holdout_is_reported_as_no_evaluation_not_a_loss_of_zero(tiny, tmp_path):
    result = invoke(_train(tiny, "no-holdout", tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "loss 0.000 → 0.000" not in result.output and "holdout: none, so nothing was evaluated" in result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["initial_eval"] == report["final_eval"] == {}


def test_resuming_a_finished_run_through_the_cli_keeps_it(tiny, tmp_path):
    first = invoke(_train(tiny, "data", tmp_path / "run"))
    assert first.exit_code == 0, first.output
    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    again = invoke(_train(tiny, "data", tmp_path / "run", "--resume"))  # what a resume-across-sessions loop does
    assert again.exit_code == 0 and again.exception is None, again.output
    holdout = [line for line in first.output.splitlines() if line.startswith("holdout: loss")]
    assert "trained 2 steps" in again.output and holdout and holdout[0] in again.output  # the run's own evaluations
    for name, tensor in load_file(tmp_path / "run" / "final" / "model.safetensors").items():
        assert tensor.equal(weights[name]), name


# ---------------------------------------------------------------- 4. help on every option of every command

def test_every_parameter_of_every_command_has_help():
    group = typer.main.get_command(app)
    missing = [f"eyas {name} {param.name}" for name, command in [("", group), *group.commands.items()]
               for param in command.params if not (getattr(param, "help", None) or "").strip()]
    assert missing == []


def test_the_learning_rate_default_is_the_sweeps_and_the_demo_keeps_its_own(tmp_path):
    from eyas.demo import demo_config

    assert 2e-3 <= TrainOptions.lr <= 5e-3  # benchmarks/LOG.md "Learning rate": the broad optimum of the sweep
    assert demo_config(tmp_path).options("train").lr == 1e-3  # the demo's own, so its τ figures hold
