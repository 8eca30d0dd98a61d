"""Options whose values cannot work end in one line and exit 2, before anything is allocated or written.

Issue 44, second round: an answer longer than the target's positions or than the memory left for its KV cache (bench
and generate: one bound, :func:`eyas.engine.room.checked_capacity`); a bench whose filters leave no prompt names the
files read and the filter that dropped them; a list-valued flag that does not parse (``--eval-temperatures abc``) is
one ``error:`` line, not click's usage box; a target model's directory given as ``--draft`` is called what it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app

HUGE = 10**12  # new tokens: a KV cache of petabytes for the tiny target, which its 2**40 positions would allow


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Tiny targets (256 positions; 2**40; 8), the same with the demo tokenizer (2,048 positions; 2**40), a DATA_DIR
    whose held-out prompts are 5, 12 and 40 tokens long, and a random drafter for the tiny target."""
    from eyas.data.samples import Sample, write_samples
    from eyas.export.files import write_draft_dir
    from eyas.families.eagle3.export import draft_config, draft_tensors
    from test_drafter_consistency import random_drafter, tiny_config
    from test_import_layouts import weights

    root = tmp_path_factory.mktemp("bounds")
    made = {"target": Path(zoo.save_tiny_target(root / "target")), "chat": Path(zoo.save_chat_target(root / "chat"))}
    made["long"] = _positions(made["target"], root / "long", 2**40)
    made["short"] = _positions(made["target"], root / "short", 8)
    made["long_chat"] = _positions(made["chat"], root / "long-chat", 2**40)
    made["data"] = Path(zoo.write_data_dir(root / "data", sizes=(("train", 6), ("holdout", 0))))
    rng = np.random.default_rng(0)
    held = [Sample(f"holdout-{i}", rng.integers(1, zoo.VOCAB, size=n + 8).astype(np.int32),
                   np.array([0] * n + [1] * 8, dtype=np.uint8)) for i, n in enumerate((5, 12, 40))]
    write_samples(held, made["data"] / "holdout.parquet")
    drafter = random_drafter(tiny_config(vocab_size=zoo.VOCAB, draft_vocab_size=100))
    config = draft_config(drafter.config, "llama", zoo.LAYERS, "fp32")
    made["draft"] = write_draft_dir(root / "draft", config, draft_tensors(weights(drafter), config, "fp32"), "")
    return made


def _positions(target: Path, copy: Path, positions: int) -> Path:
    """A copy of ``target`` whose config.json gives it ``positions`` positions (RoPE: the weights stay valid)."""
    shutil.copytree(target, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return copy


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def error_line(result, *named) -> str:
    """Exit 2 with exactly one ``error:`` line, naming each of ``named``; no traceback, no usage box."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Usage:" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    for name in named:
        assert str(name) in errors[0], (name, errors[0])
    return errors[0]


def bench(made, target: str, out: Path, *more) -> list:
    return ["bench", "--target", made[target], "--draft", made["draft"], "--out", out, "--dataset", "sharegpt-holdout",
            "--data", made["data"], "--mode", "chain:2", "--temperature", "0", "--device", "cpu", *more]


# ---------------------------------------------------------------- 1. positions and memory, before any cache

@pytest.mark.parametrize("new_tokens", [300, 10**9])  # 300: memory is no matter, the positions are
def test_bench_refuses_an_answer_beyond_the_targets_positions(made, tmp_path, new_tokens):
    line = error_line(invoke(*bench(made, "target", tmp_path / "report", "--max-new-tokens", new_tokens)),
                      f"--max-new-tokens {new_tokens}", "prompts of up to 40 tokens", f"{new_tokens + 42:,} positions",
                      "the target has 256 (max_position_embeddings)")
    assert line.endswith("use --max-new-tokens ≤ 214")  # 256 − the longest prompt (40) − the chain's depth (2)
    assert not (tmp_path / "report").exists()


def test_bench_whose_prompts_alone_fill_the_positions_says_to_lower_max_prompt_tokens(made, tmp_path):
    error_line(invoke(*bench(made, "short", tmp_path / "report", "--max-new-tokens", 2)),
               "the target has 8 (max_position_embeddings)", "lower --max-prompt-tokens", "40 tokens")
    assert not (tmp_path / "report").exists()


def test_generate_refuses_an_answer_beyond_the_targets_positions(made):
    error_line(invoke("generate", "Name a colour.", "--target", made["chat"], "--device", "cpu", "--max-new-tokens", 10**9),
               "--max-new-tokens 1000000000 with a prompt of", "the target has 2,048 (max_position_embeddings)",
               "use --max-new-tokens ≤")


def test_a_cuda_device_this_machine_lacks_is_refused_not_replaced_by_the_cpu(made, tmp_path, monkeypatch):
    """--device cuda where torch sees no GPU was placed on the CPU without a word (transformers' device_map), and the
    report said cpu: one line now, before the target loads."""
    import torch

    from eyas.errors import EyasError
    from eyas.target.loading import require_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    error_line(invoke(*bench(made, "target", tmp_path / "report", "--max-new-tokens", 2, "--device", "cuda")),  # the last
               "--device cuda: torch sees no CUDA device", "--device cpu")
    error_line(invoke("generate", "Hi", "--target", made["chat"], "--device", "cuda:0"), "--device cuda:0")
    assert not (tmp_path / "report").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EyasError, match=r"--device cuda:2: this machine has 2 CUDA devices \(cuda:0 … cuda:1\)"):
        require_device("cuda:2")
    assert require_device("cpu") == torch.device("cpu") and require_device("cuda:1") == torch.device("cuda:1")


def test_bench_and_generate_refuse_a_kv_cache_larger_than_the_memory(made, tmp_path):
    line = error_line(invoke(*bench(made, "long", tmp_path / "report", "--max-new-tokens", HUGE)),
                      f"--max-new-tokens {HUGE}", "needs a KV cache of", "this machine's RAM has", "use --max-new-tokens")
    assert "PiB" in line or "GiB" in line
    assert not (tmp_path / "report").exists()
    error_line(invoke("generate", "Name a colour.", "--target", made["long_chat"], "--device", "cpu", "--max-new-tokens",
                      HUGE), "needs a KV cache of", "this machine's RAM has", "use --max-new-tokens")


# ---------------------------------------------------------------- 2. no prompts left: which file, which filter

def test_no_prompts_left_names_the_file_and_the_filter_that_dropped_them(made, tmp_path):
    line = error_line(invoke(*bench(made, "target", tmp_path / "report", "--max-new-tokens", 2, "--max-prompt-tokens", 4)),
                      "no prompts left to benchmark", made["data"] / "holdout.parquet",
                      "--max-prompt-tokens 4 dropped 3 of 3", "raise --max-prompt-tokens")
    assert "train.parquet" not in line  # the training prompts dropped none
    assert not (tmp_path / "report").exists()
    kept = invoke(*bench(made, "target", tmp_path / "kept", "--max-new-tokens", 2, "--max-prompt-tokens", 5, "--prompts", 1))
    assert kept.exit_code == 0, kept.output  # the bound is inclusive: the 5-token prompt stays


def test_no_prompts_left_names_the_training_split_that_holds_them(made, tmp_path):
    from eyas.data.samples import read_samples, write_samples

    data = Path(shutil.copytree(made["data"], tmp_path / "data"))
    held = read_samples(data / "holdout.parquet")
    write_samples(read_samples(data / "train.parquet") + held, data / "train.parquet")  # every prompt leaked
    line = error_line(invoke(*bench({**made, "data": data}, "target", tmp_path / "report", "--max-new-tokens", 2)),
                      "3 of 3 open a training conversation", data / "train.parquet", data / "holdout.parquet")
    assert "--max-prompt-tokens 1024 dropped" not in line
    assert not (tmp_path / "report").exists()


# ---------------------------------------------------------------- 3. a list-valued flag that does not parse

def test_a_bad_eval_temperatures_is_one_error_line_naming_the_flag(made, tmp_path):
    for value, says in [("abc", "expected one or more comma-separated float values (each > 0)"),
                        ("", "expected one or more comma-separated float values"),
                        ("1,x", "expected one or more comma-separated float values"),
                        ("-1", "each must be > 0")]:  # -1 parses: the field's own check refuses it, as before
        result = invoke("train", "--target", made["target"], "--out", tmp_path / "run", "--eval-temperatures", value)
        error_line(result, "--eval-temperatures", says)
        assert not (tmp_path / "run").exists()


def test_a_bad_list_in_any_command_is_one_error_line(made, tmp_path):
    error_line(invoke(*bench(made, "target", tmp_path / "report", "--temperature", "")), "--temperature ''",
               "expected one or more comma-separated float values")
    error_line(invoke(*bench(made, "target", tmp_path / "report", "--concurrency", "4,many")), "--concurrency '4,many'",
               "comma-separated int values")
    assert not (tmp_path / "report").exists()


# ---------------------------------------------------------------- 4. a target's directory given as the drafter

@pytest.fixture
def no_target_loading(monkeypatch):
    import eyas.target.loading

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before --draft was read")

    monkeypatch.setattr(eyas.target.loading, "load_target", refuse)


@pytest.mark.parametrize("mode", [[], ["--mode", "chain:2"]])  # the family's default modes read --draft first
def test_bench_and_generate_call_a_target_given_as_draft_a_target(made, tmp_path, no_target_loading, mode):
    target = made["target"]
    args = ["bench", "--target", target, "--draft", target, "--out", tmp_path / "report", "--dataset", "sharegpt-holdout",
            "--data", made["data"], "--device", "cpu", *mode]
    says = [f"{target} is a target model, not a drafter", "LlamaForCausalLM", "8 decoder layers", "eyas export",
            f"{target} itself goes to --target"]
    error_line(invoke(*args), *says)
    assert not (tmp_path / "report").exists()
    error_line(invoke("generate", "hello", "--target", made["chat"], "--draft", target, "--device", "cpu", *mode), *says)
    checked = invoke("check", target)
    assert checked.exit_code == 1 and f"{target} is a target model" in checked.output
    assert invoke("check", made["draft"]).exit_code == 0  # an eyas drafter is none
