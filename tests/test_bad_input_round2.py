"""Issue 44, second round: drafter options no model can be built from, --resume into an --out holding no run, a GGUF
target without a chat template, and failed stages that left empty directories behind.

Each refusal exits 2 with one `error:` line naming the flag or file, no traceback, before the expensive step it spares
(the target's weights, a GGUF's conversion), and creates nothing; a stage that fails leaves no directory it made or
emptied.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app


def invoke(args: list[str]):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def one_error_line(result, *named: str) -> str:
    """The run exited 2 with one one-line `error:` naming each of ``named``, and no traceback."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # exited, did not crash
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    for name in named:
        assert name in errors[0], (name, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target (hidden 64, 4 heads of 16, 256 tokens) and a DATA_DIR for it."""
    root = tmp_path_factory.mktemp("round2")
    target = zoo.save_tiny_target(root / "target")
    data = zoo.write_data_dir(root / "data", sizes=(("train", 6), ("holdout", 2)))
    return Path(target), Path(data)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The same tiny Llama as GGUF files: a base model (no chat template) and a chat model."""
    root = tmp_path_factory.mktemp("ggufs")
    base, _ = zoo.write_tiny_gguf(root / "base.gguf")
    chat, _ = zoo.write_tiny_gguf(root / "chat.gguf", chat_template="{{ messages[0]['content'] }}")
    return base, chat


@pytest.fixture
def no_conversion(tmp_path, monkeypatch) -> Path:
    """An empty eyas cache in which converting a GGUF fails the test; → the cache's path."""
    from eyas.target import gguf as gguf_module

    cache = tmp_path / "cache"
    monkeypatch.setenv("EYAS_CACHE", str(cache))
    monkeypatch.setattr(gguf_module, "_convert", lambda *a: (_ for _ in ()).throw(AssertionError("GGUF converted")))
    return cache


# ---------------------------------------------------------------- 1. drafter options no model can be built from

def _no_target_weights(monkeypatch):
    """Reading the target's weights (its identity, the training setup) fails the test: the refusal comes first."""
    import eyas.train.trainer

    def read(*args, **kwargs):
        raise AssertionError("the target was read before the drafter options were checked")

    monkeypatch.setattr(eyas.train.trainer, "target_identity", read)
    monkeypatch.setattr(eyas.train.trainer, "setup_training", read)


DRAFTERS = [  # (flags, what the one line names: the flag and value, a value that builds)
    (["--hidden-size", "100"], ["--hidden-size 100", "6 attention heads", "--hidden-size 96 or 112"]),
    (["--hidden-size", "33"], ["--hidden-size 33", "2 attention heads", "--hidden-size 32 or 48"]),
    (["--drafter", "dflash", "--mask-token-id", "256"], ["--mask-token-id 256", "--mask-token-id 255"]),
]


@pytest.mark.parametrize("flags, named", DRAFTERS, ids=["width-100", "width-33", "dflash-mask"])
def test_drafter_options_no_model_can_be_built_from_are_refused_before_the_target_is_read(tiny, tmp_path, monkeypatch,
                                                                                           flags, named):
    target, data = tiny
    _no_target_weights(monkeypatch)
    out = tmp_path / "run"
    one_error_line(invoke(["train", "--target", target, "--data", data, "--out", out, "--max-steps", "1", *flags]), *named)
    assert list(tmp_path.iterdir()) == []  # no RUN_DIR


def test_a_drafter_width_is_judged_from_a_gguf_s_header_without_converting_it(tiny, ggufs, no_conversion, tmp_path,
                                                                             monkeypatch):
    _, data = tiny
    _no_target_weights(monkeypatch)
    out = tmp_path / "run"
    one_error_line(invoke(["train", "--target", ggufs[0], "--data", data, "--out", out, "--hidden-size", "100"]),
                   "--hidden-size 100", "--hidden-size 96 or 112")
    assert not out.exists() and not (no_conversion / "gguf").exists()


@pytest.mark.parametrize("width", [8, 16, 40, 96, 112, 64])
def test_the_widths_the_refusal_names_and_others_the_heads_divide_build(tiny, width):
    from transformers import AutoConfig

    from eyas import families
    from eyas.families.eagle3.config import drafter_config_from_target
    from eyas.train.options import TrainOptions

    config = AutoConfig.from_pretrained(tiny[0])
    families.named("eagle3").validate(TrainOptions(target="t", out=Path("o"), hidden_size=width), config)
    drafter = drafter_config_from_target(config, [2, 4, 5], 100, width)
    assert drafter.llama_config().hidden_size == width  # transformers' own check passes


# ---------------------------------------------------------------- 2. --resume into an --out holding no run

@pytest.mark.parametrize("made", [False, True], ids=["missing", "empty"])
def test_resume_into_an_out_holding_no_run_says_it_starts_a_new_one(tiny, tmp_path, made):
    """A note, not a refusal: the same `--resume` command starts a run and continues it (job queues, torchrun in
    docs/recipe.md, eyas run)."""
    target, data = tiny
    out = tmp_path / "run"
    if made:
        out.mkdir()
    result = invoke(["train", "--target", target, "--data", data, "--out", out, "--resume", "--max-steps", "1",
                     "--ttt-steps", "1", "--token-budget", "256", "--eval-batches", "1"])
    assert result.exit_code == 0, result.output
    note = f"--resume: {out} holds no run to resume (no train_options.json, no checkpoint): starting a new run"
    assert result.output.count(note) == 1, result.output
    assert json.loads((out / "report.json").read_text())["resumed_from"] is None  # a new run, not a resumed one


# ---------------------------------------------------------------- 3. a GGUF target without a chat template

def test_prepare_refuses_a_gguf_without_a_chat_template_before_converting_it(ggufs, no_conversion, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "c0", "conversations": [{"from": "human", "value": "Hi"},
                                                               {"from": "gpt", "value": "Hello."}]}) + "\n")
    out = tmp_path / "data"
    one_error_line(invoke(["prepare", "--target", ggufs[0], "--data", chats, "--out", out]),
                   "no chat template", "--chat-template FILE")
    assert not out.exists() and not (no_conversion / "gguf").exists()  # no DATA_DIR, no conversion in the cache


def test_bench_and_generate_refuse_a_gguf_without_a_chat_template_before_converting_it(ggufs, no_conversion, tmp_path):
    out = tmp_path / "report"
    one_error_line(invoke(["bench", "--target", ggufs[0], "--draft", tmp_path / "any", "--out", out, "--dataset",
                           "mt-bench", "--mode", "chain:2", "--device", "cpu"]), "no chat template", "--chat-template FILE")
    one_error_line(invoke(["generate", "Hi", "--target", ggufs[0], "--device", "cpu"]), "no chat template")
    assert not out.exists() and not (no_conversion / "gguf").exists()


def test_a_gguf_s_header_says_whether_it_ships_a_chat_template(ggufs, tiny):
    from eyas.target.loading import ships_chat_template

    assert [ships_chat_template(str(g)) for g in ggufs] == [False, True]
    assert ships_chat_template(str(tiny[0])) is None  # an HF directory: its tokenizer tells


# ---------------------------------------------------------------- 4. failed stages leave no empty directory

def _capture(tiny, out: Path, *flags) -> list:
    target, data = tiny
    return ["capture", "--target", target, "--data", data, "--out", out, "--dtype", "fp32", "--token-budget", "256",
            *flags]


def test_capture_without_a_vllm_python_is_refused_and_creates_nothing(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    out = tmp_path / "features"
    one_error_line(invoke(_capture(tiny, out, "--engine", "vllm")), "--vllm-python", "EYAS_VLLM_PYTHON")
    assert list(tmp_path.iterdir()) == []


def test_capture_whose_vllm_engine_fails_to_start_leaves_no_directory(tiny, tmp_path):
    python = tmp_path / "vllm-python"  # finds "vllm" (the probe), then dies as an engine that cannot start
    python.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "engine failed to start" >&2\nexit 7\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "place" / "features"
    one_error_line(invoke(_capture(tiny, out, "--engine", "vllm", "--vllm-python", python)), "exit status 7",
                   "engine failed to start")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-python"]  # neither --out nor the parent made for it


def _fill_the_disk(monkeypatch):
    """Every shard write fails from here on, as on a full disk."""
    import eyas.capture.stage

    def write_shard(path, packs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(eyas.capture.stage, "write_shard", write_shard)


def test_a_full_disk_leaves_no_empty_features_dir(tiny, tmp_path, monkeypatch):
    _fill_the_disk(monkeypatch)
    out = tmp_path / "features"
    one_error_line(invoke(_capture(tiny, out)), str(out), "No space left on device", "rerun the same command")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_under_force_says_the_old_store_is_gone_and_leaves_no_empty_directory(tiny, tmp_path, monkeypatch):
    out = tmp_path / "features"
    assert invoke(_capture(tiny, out)).exit_code == 0  # a complete store, then replaced with --force on a full disk
    _fill_the_disk(monkeypatch)
    line = one_error_line(invoke(_capture(tiny, out, "--force")), str(out), "No space left on device")
    assert "with --force the store --out held before" in line and "rerun without --force to resume" in line
    assert list(tmp_path.iterdir()) == []  # not an empty directory where the store was


def test_only_empty_folders_a_failed_stage_made_or_emptied_are_removed(tmp_path):
    from eyas.outputs import no_empty_leftover

    def fail(out: Path, write=lambda out: None):
        with pytest.raises(RuntimeError), no_empty_leftover(out):
            write(out)
            raise RuntimeError("the stage failed")

    fail(tmp_path / "a" / "b" / "out", lambda out: (out / "sub").mkdir(parents=True))
    assert list(tmp_path.iterdir()) == []  # out, its empty folder and the parents made for it
    (tmp_path / "mine" / "own").mkdir(parents=True)
    fail(tmp_path / "mine", lambda out: (out / "own" / "new").mkdir() or (out / "new").mkdir())
    assert [p.name for p in (tmp_path / "mine").rglob("*")] == ["own"]  # the user's empty directory, as it was
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "old").write_text("old")
    fail(tmp_path / "store", lambda out: (out / "old").unlink())
    assert not (tmp_path / "store").exists()  # emptied by the stage (--force): not left empty
    fail(tmp_path / "kept", lambda out: (out / "shards").mkdir(parents=True) or (out / "shards" / "x").write_text("x"))
    assert (tmp_path / "kept" / "shards" / "x").is_file()  # what a rerun resumes from stays
