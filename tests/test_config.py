"""Run configs and `eyas run`: TOML over the stages' defaults, --set over the file, clear errors, resumable runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app
from eyas.config import ConfigError, load_config
from eyas.train.options import TrainOptions

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_loads_and_builds_each_stage(example):
    config = load_config(example)
    assert config.stages and config.target
    for stage in config.stages:
        config.options(stage)  # every key is a real option of a valid type


def test_file_over_defaults_and_set_over_file(tmp_path):
    path = write(tmp_path / "c.toml", 'target = "demo"\nworkdir = "w"\n[train]\nlr = 5e-4\nttt_steps = 3\n'
                                      '[prepare.regeneration]\nbatch_size = 64\n')
    config = load_config(path, ["train.lr=1e-3", "bench.prompts=4", "prepare.data=['a.jsonl', 'b.jsonl']"])
    train = config.options("train")
    assert (train.lr, train.ttt_steps, train.token_budget) == (1e-3, 3, TrainOptions.token_budget)
    prepare = config.options("prepare")
    assert prepare.regeneration.batch_size == 64 and prepare.regeneration.max_new_tokens == 1024  # nested default kept
    assert prepare.data == ["a.jsonl", "b.jsonl"]
    assert prepare.regeneration.temperature == (0.0,)  # the default: greedy answers only
    one = load_config(write(tmp_path / "t.toml", 'target = "demo"\nworkdir = "w"\n[prepare]\ndata = ["a"]\n'
                                                 '[prepare.regeneration]\ntemperature = 0.8\n'), ["bench.temperature=0.5"])
    assert one.options("prepare").regeneration.temperature == (0.8,)  # one number: a tuple of one
    assert one.options("bench").temperature == (0.5,)
    assert load_config(path, ["prepare.data=['a']", "prepare.regeneration.temperature=[0.0, 0.8]"]).options(
        "prepare").regeneration.temperature == (0.0, 0.8)
    assert config.options("bench").prompts == 4
    assert config.stages == ("prepare", "train", "export", "bench") and config.folder("train") == Path("w/run")


@pytest.mark.parametrize("text, overrides, message", [
    ('target = "demo"\nworkdir = "w"\n[train]\nlearning_rate = 1\n', [], r"\[train\]: unknown option 'learning_rate'"),
    ('target = "demo"\nworkdir = "w"\n[train]\nttt_step = 1\n', [], r"did you mean 'ttt_steps'"),
    ('target = "demo"\nworkdir = "w"\n[train]\nttt_steps = "7"\n', [], r"ttt_steps: expected a whole number"),
    ('target = "demo"\nworkdir = "w"\n[train]\nonline = 1\n', [], r"online: expected true or false"),
    ('target = "demo"\nworkdir = "w"\n[train]\nout = "x"\n', [], r"'out' is set by eyas run"),
    ('target = "demo"\nworkdir = "w"\nstages = ["prepare", "trian"]\n', [], r"unknown stage 'trian'.*'train'"),
    ('workdir = "w"\n', [], r"'target' is required"),
    ('target = "demo"\n', [], r"'workdir' is required"),
    ('target = "demo"\nworkdir = "w"\n[train\n', [], r"is not valid TOML"),
    ('target = "demo"\nworkdir = "w"\n[bench]\ntemperature = []\n', [], r"temperature = \[\]: must hold one or more"),
    ('target = "demo"\nworkdir = "w"\n', ["train.lr"], r"expected section.key=value"),
    ('target = "demo"\nworkdir = "w"\n', ["train.lr=fast"], r"lr: expected a number, got 'fast'"),
])
def test_config_mistakes_name_the_file_and_the_key(tmp_path, text, overrides, message):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


def test_a_config_that_is_not_utf8_text_or_is_a_directory_is_one_line(tmp_path):
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00t")
    (tmp_path / "folder.toml").mkdir()
    for name, says in (("binary.toml", "is not UTF-8 text (byte 0"), ("folder.toml", "is a directory")):
        result = CliRunner().invoke(app, ["run", str(tmp_path / name)])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0] and str(tmp_path / name) in errors[0], result.output


def test_the_large_moe_example_is_what_inspect_reads():
    """examples/kimi-k2.5 holds the published config structure; inspect finds the text stack and the ids."""
    from eyas.target.describe import describe_target

    info = json.loads(json.dumps(describe_target(str(EXAMPLES / "kimi-k2.5")).__dict__, default=str))
    text = json.dumps(info)
    assert "language_model.layers" in text and "7168" in text and "163840" in text
    assert "[2, 30, 58]" in text and "[1, 29, 57]" in text


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return zoo.save_chat_target(tmp_path_factory.mktemp("tiny-target"))  # 8 layers: the default taps fit


def test_eyas_run_goes_from_data_to_a_bench_report_and_a_rerun_resumes(tmp_path, tiny_target):
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"What is {i} times {i}?"},
                                              {"from": "gpt", "value": f"It is {i * i}, since {i} x {i} = {i * i}."}]}
            for i in range(40)]
    data = write(tmp_path / "chats.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    workdir = tmp_path / "work"
    config = write(tmp_path / "run.toml", f'''
target = "{tiny_target}"
workdir = "{workdir}"
[prepare]
data = ["{data}"]
max_length = 64
holdout = 0.2
draft_vocab_size = 512
[train]
max_steps = 2
token_budget = 256
ttt_steps = 2
checkpoint_every = 2
eval_batches = 1
[export]
dtype = "fp32"
[bench]
datasets = ["sharegpt-holdout"]
modes = "chain:2"
prompts = 1
max_new_tokens = 4
device = "cpu"
temperature = [0.0]
''')
    runner = CliRunner()
    first = runner.invoke(app, ["run", str(config)])
    assert first.exit_code == 0, first.output
    for produced in ("data/manifest.json", "run/final/model.safetensors", "draft/config.json", "bench/report.json"):
        assert (workdir / produced).is_file(), produced
    report = json.loads((workdir / "bench/report.json").read_text())
    assert report["draft"] == str(workdir / "draft") and list(report["datasets"]) == ["sharegpt-holdout"]
    assert [(r["dataset"], r["mode"]) for r in report["rows"]] == [("sharegpt-holdout", "chain:2")]
    again = runner.invoke(app, ["run", str(config), "--set", "train.max_steps=3", "--stages", "prepare,train"])
    assert again.exit_code == 0, again.output
    assert "skipped" in again.output  # DATA_DIR already prepared with these options
    steps = [json.loads(line).get("step") for line in (workdir / "run/metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 3  # resumed at step 2, one more step
    wrong = runner.invoke(app, ["run", str(config), "--stages", "capture"])
    assert wrong.exit_code == 2 and "not among the config's stages" in wrong.output


def test_eyas_run_names_the_override_where_a_stage_names_its_flag(tmp_path, tiny_target):
    rows = [{"id": "c0", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}]
    data = write(tmp_path / "chats.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    workdir = tmp_path / "work"
    (workdir / "data").mkdir(parents=True)
    write(workdir / "data" / "notes.txt", "someone else's file\n")  # DATA_DIR is not empty: prepare refuses
    config = write(tmp_path / "run.toml", f'target = "{tiny_target}"\nworkdir = "{workdir}"\nstages = ["prepare"]\n'
                                          f'[prepare]\ndata = ["{data}"]\n')
    refused = CliRunner().invoke(app, ["run", str(config)])
    assert refused.exit_code == 2, refused.output
    assert "--set prepare.force=true" in refused.output and "--force " not in refused.output, refused.output
    assert (workdir / "data" / "notes.txt").read_text() == "someone else's file\n"
