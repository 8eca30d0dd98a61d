"""Issue 44, second round: `eyas train` options that would be ignored, would learn nothing, or cannot fit the machine.

An option only another drafter family reads (`--drafter dflash --hidden-size 100`), a block or a TTT unroll longer
than every training sample (a silent loss of 0), a drafter whose weights, gradients and AdamW states exceed the free
memory (an 80 GB allocation's traceback), and — through `eyas run` — drafter options no model can be built from, found
only when training starts after prepare and capture: each is one `error:` line naming the flag, exit 2, no traceback,
and nothing created. A run whose steps counted no position at all ends in one line, not in a "trained" drafter.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app


def invoke(args: list) -> object:
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def one_error_line(result, *named: str) -> str:
    """Exit 2, one `error:` line naming each of ``named``, no traceback."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    for name in named:
        assert name in errors[0], (name, errors[0])
    return errors[0]


def masked_data_dir(directory: Path, like: Path, length: int, trained: slice) -> Path:
    """A DATA_DIR of six samples of ``length`` tokens whose only trained tokens are ``trained`` (the vocabulary and
    manifest copied from ``like``)."""
    from eyas.data.samples import Sample, write_samples

    rng = np.random.default_rng(1)
    directory.mkdir()
    for split, count in (("train", 6), ("holdout", 2)):
        samples = []
        for i in range(count):
            mask = np.zeros(length, dtype=np.uint8)
            mask[trained] = 1
            samples.append(Sample(f"{split}-{i}", rng.integers(1, zoo.VOCAB, size=length).astype(np.int32), mask))
        write_samples(samples, directory / f"{split}.parquet")
    for name in ("vocab.safetensors", "manifest.json"):
        shutil.copy(like / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny Llama target (hidden 64, heads of 16), a DATA_DIR for it (its longest sample's length), and DATA_DIRs whose
    trained tokens no block of 10 and no TTT step can reach."""
    from eyas.data.samples import read_samples

    root = tmp_path_factory.mktemp("train-options")
    target = zoo.save_tiny_target(root / "target")
    data = Path(zoo.write_data_dir(root / "data", sizes=(("train", 6), ("holdout", 2))))
    longest = max(len(s.input_ids) for s in read_samples(data / "train.parquet"))
    return {"target": target, "data": data, "longest": longest,
            "late": masked_data_dir(root / "late", data, 20, slice(16, None)),  # blocks of 10 anchor at 1 … 10
            "untrained": masked_data_dir(root / "untrained", data, 20, slice(0, 0))}


@pytest.fixture
def no_target_weights(monkeypatch):
    """Reading the target's weights fails the test: the refusal comes before."""
    import eyas.train.trainer

    def read(*args, **kwargs):
        raise AssertionError("the target's weights were read before the options were checked")

    monkeypatch.setattr(eyas.train.trainer, "target_identity", read)
    monkeypatch.setattr(eyas.train.trainer, "setup_training", read)


def train_args(tiny, out: Path, *flags) -> list:
    return ["train", "--target", tiny["target"], "--data", tiny["data"], "--out", out, "--max-steps", "2", *flags]


# ---------------------------------------------------------------- 1. an option only another family reads

UNREAD = [  # (flags, what the line names)
    (["--drafter", "dflash", "--hidden-size", "64"], ["--hidden-size is an option of eagle3 drafters",
                                                     "--drafter dflash does not read it", "--drafter eagle3"]),
    (["--drafter", "dflash", "--ttt-steps", "3", "--step-decay", "0.5"], ["--ttt-steps, --step-decay", "eagle3",
                                                                        "--drafter dflash does not read them"]),
    (["--block-size", "8"], ["--block-size is an option of dflash drafters", "--drafter eagle3 does not read it",
                             "--drafter dflash"]),
]


@pytest.mark.parametrize("flags, named", UNREAD, ids=["dflash-hidden-size", "dflash-ttt", "eagle3-block-size"])
def test_an_option_only_another_family_reads_is_refused_before_anything_loads(tiny, tmp_path, no_target_weights,
                                                                             flags, named):
    one_error_line(invoke(train_args(tiny, tmp_path / "run", *flags)), *named)
    assert list(tmp_path.iterdir()) == []


def test_another_family_s_option_is_refused_only_off_its_default_and_a_shared_one_never():
    from eyas.errors import EyasError
    from eyas.train.options import TrainOptions

    TrainOptions(target="t", out=Path("o"), drafter="dflash", ttt_steps=7, hidden_size=None)  # the defaults: ignored
    TrainOptions(target="t", out=Path("o"), drafter="dflash", block_size=4, layer_ids=(1, 2, 3), lr=1e-3)
    with pytest.raises(EyasError, match="--ttt-steps is an option of eagle3 drafters"):
        TrainOptions(target="t", out=Path("o"), drafter="dflash", ttt_steps=8)


def test_a_run_config_s_train_section_goes_through_the_same_check(tiny, tmp_path):
    workdir = tmp_path / "work"
    config = tmp_path / "run.toml"
    config.write_text(f'target = "{tiny["target"]}"\nworkdir = "{workdir}"\nstages = ["train"]\n'
                      '[train]\ndrafter = "dflash"\nhidden_size = 64\n')
    line = one_error_line(invoke(["run", config]), "[train]", "hidden_size is an option of eagle3 drafters",
                          'drafter = "dflash" does not read it')
    assert str(config) in line and not workdir.exists()
    one_error_line(invoke(["run", config, "--set", "train.hidden_size=none", "--set", "train.drafter=eagle3",
                           "--set", "train.block_size=4"]), "block_size is an option of dflash drafters")
    assert not workdir.exists()


def test_a_resume_compares_no_option_its_family_does_not_read(tiny, tmp_path):
    from eyas.manifest import jsonable
    from eyas.train.options import TrainOptions
    from eyas.train.resume import resume_changes

    options = TrainOptions(target=tiny["target"], out=tmp_path, data=tiny["data"], online=True, drafter="dflash")
    recorded = {**jsonable(options), "hidden_size": 48, "ttt_steps": 3}  # written by an eyas that recorded them
    assert resume_changes(recorded, options, 1, tmp_path, {}) == {}


# ---------------------------------------------------------------- 2. options under which no sample has a position to learn from

def test_a_block_longer_than_every_sample_is_refused_before_anything_is_written(tiny, tmp_path):
    longest = tiny["longest"]
    one_error_line(invoke(train_args(tiny, tmp_path / "run", "--drafter", "dflash", "--block-size", "500")),
                   "--block-size 500", f"holds {longest} tokens", f"--block-size {longest - 1} or less")
    assert list(tmp_path.iterdir()) == []


def test_a_dspark_block_longer_than_every_sample_is_refused_before_anything_is_written(tiny, tmp_path):
    longest = tiny["longest"]  # every token a block proposes lies inside the sample, after an anchor ≥ 1
    one_error_line(invoke(train_args(tiny, tmp_path / "run", "--drafter", "dspark", "--spark-block", "500")),
                   "--spark-block 500", f"holds {longest} tokens", f"--spark-block {longest - 2} or less")
    assert list(tmp_path.iterdir()) == []


def test_a_ttt_unroll_longer_than_every_sample_is_refused_before_anything_is_written(tiny, tmp_path):
    longest = tiny["longest"]
    one_error_line(invoke(train_args(tiny, tmp_path / "run", "--ttt-steps", "500")),
                   "--ttt-steps 500", f"holds {longest} tokens", f"--ttt-steps {longest - 2} or less")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("data, flags, named", [
    ("late", ["--drafter", "dflash", "--block-size", "10"], ["lower --block-size (now 10)"]),
    ("late", ["--drafter", "dspark", "--spark-block", "10"], ["lower --spark-block (now 10)"]),
    ("untrained", ["--ttt-steps", "2"], ["trained (assistant) tokens"]),
], ids=["dflash-blocks-before-every-trained-token", "dspark-blocks-before-every-trained-token", "eagle3-no-trained-token"])
def test_a_run_whose_steps_count_no_position_ends_in_one_line_not_a_trained_drafter(tiny, tmp_path, data, flags, named):
    run = tmp_path / "run"
    args = ["train", "--target", tiny["target"], "--data", tiny[data], "--out", run, "--max-steps", "3", *flags]
    line = one_error_line(invoke(args), "found no position to learn from", f"--data {tiny[data]}", *named)
    assert "1 training step " in line  # refused once every batch was seen (one here), before its checkpoint
    assert not (run / "final").exists() and not (run / "checkpoints").exists()
    assert not (run / "report.json").exists()


def test_a_run_that_ends_before_every_batch_having_counted_no_position_says_so(tiny, tmp_path):
    run = tmp_path / "run"
    result = invoke(["train", "--target", tiny["target"], "--data", tiny["untrained"], "--out", run, "--max-steps", "1",
                     "--ttt-steps", "2", "--token-budget", "40"])
    assert result.exit_code == 0, result.output
    warnings = re.findall(r"warning: [^\n]*", result.output)  # (CliRunner mixes in stderr's progress bars)
    assert len(warnings) == 1 and "1 training step (1 of the 3 training batches" in warnings[0], result.output
    assert "found no position to learn from" in warnings[0] and "drafter stays as initialised" in warnings[0]


# ---------------------------------------------------------------- 3. a drafter that cannot fit the free memory

@pytest.fixture
def one_gib_free(monkeypatch):
    """The training device has 1 GiB free, whatever this machine has."""
    monkeypatch.setattr("eyas.train.checks.free_memory", lambda device: 1 << 30)


@pytest.mark.parametrize("flags, named", [
    (["--hidden-size", "100000"], ["at least 2.2 TiB", "1.0 GiB free", "--hidden-size 2080 or less",
                                   "leave it out (the target's width, 64)"]),
    (["--drafter", "dflash", "--draft-layers", "100000"], ["at least 55.2 GiB", "1.0 GiB free",
                                                          "--draft-layers 1812 or fewer"]),
    (["--drafter", "dspark", "--draft-layers", "100000"], ["1.0 GiB free", "at least 55.2 GiB", "--draft-layers 1808 or fewer"]),
    (["--drafter", "dspark", "--markov-rank", "10000000"], ["1.0 GiB free", "at least 76.3 GiB", "give --markov-rank 130702 or less"]),
], ids=["eagle3-width", "dflash-layers", "dspark-layers", "dspark-rank"])
def test_a_drafter_whose_training_state_exceeds_the_free_memory_is_refused_before_it_is_built(
        tiny, tmp_path, no_target_weights, one_gib_free, flags, named):
    one_error_line(invoke(train_args(tiny, tmp_path / "run", *flags)), *named)
    assert list(tmp_path.iterdir()) == []


def test_the_estimate_is_the_drafter_s_own_parameter_count(tiny):
    from transformers import AutoConfig

    from eyas.families.dflash.config import dflash_config_from_target, parameter_count
    from eyas.families.dflash.model import DFlashDrafter
    from eyas.families.eagle3.config import drafter_config_from_target
    from eyas.families.eagle3.memory import parameter_counts
    from eyas.families.eagle3.model import Eagle3Drafter

    config = AutoConfig.from_pretrained(tiny["target"])
    for width in (None, 32, 96):
        drafter = Eagle3Drafter(drafter_config_from_target(config, [2, 4, 5], 100, width))
        trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        assert parameter_counts(drafter.config) == (trained, sum(p.numel() for p in drafter.parameters()) - trained)
    drafter = DFlashDrafter(dflash_config_from_target(config, [2, 4, 5], 4, 3))
    assert parameter_count(drafter.config) == sum(p.numel() for p in drafter.parameters())
    from eyas.families.dspark.config import dspark_config_from_target, spark_parameter_count
    from eyas.families.dspark.model import DSparkDrafter

    drafter = DSparkDrafter(dspark_config_from_target(config, [2, 4, 5], 4, 3, 16))
    assert spark_parameter_count(drafter.config) == sum(p.numel() for p in drafter.parameters())


# ---------------------------------------------------------------- 4. eyas run checks training's options before its first stage

def run_config(tiny, tmp_path: Path, train: str) -> tuple[Path, Path]:
    """A config whose prepare stage would fail the test if it ran (→ config, workdir)."""
    workdir = tmp_path / "work"
    config = tmp_path / "run.toml"
    config.write_text(f'target = "{tiny["target"]}"\nworkdir = "{workdir}"\nstages = ["prepare", "train"]\n'
                      f'[prepare]\ndata = ["{tiny["data"]}/train.parquet"]\n[train]\n{train}\n')
    return config, workdir


@pytest.fixture
def no_stage_runs(monkeypatch):
    import dataclasses

    import eyas.stages

    def ran(options, console):
        raise AssertionError("a stage ran before training's options were checked")

    for name, stage in list(eyas.stages.STAGES.items()):
        monkeypatch.setitem(eyas.stages.STAGES, name, dataclasses.replace(stage, run=ran))


@pytest.mark.parametrize("train, named", [
    ("hidden_size = 100", ["--hidden-size 100", "--hidden-size 96 or 112"]),
    ('drafter = "dflash"\nmask_token_id = 256', ["--mask-token-id 256", "--mask-token-id 255"]),
], ids=["width", "dflash-mask"])
def test_eyas_run_refuses_training_s_drafter_options_before_its_first_stage(tiny, tmp_path, no_stage_runs, train, named):
    config, workdir = run_config(tiny, tmp_path, train)
    one_error_line(invoke(["run", config]), *named)
    assert not workdir.exists()


def test_eyas_run_refuses_a_drafter_too_large_for_the_memory_before_its_first_stage(tiny, tmp_path, no_stage_runs,
                                                                                   one_gib_free):
    config, workdir = run_config(tiny, tmp_path, "hidden_size = 100000")
    one_error_line(invoke(["run", config]), "--hidden-size 2080 or less", "1.0 GiB free")
    assert not workdir.exists()


def test_eyas_run_judges_a_gguf_target_from_its_header_without_converting_it(tiny, tmp_path, no_stage_runs,
                                                                            monkeypatch):
    from eyas.target import gguf as gguf_module

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_module, "_convert", lambda *a: (_ for _ in ()).throw(AssertionError("GGUF converted")))
    gguf, _ = zoo.write_tiny_gguf(tmp_path / "base.gguf")
    config, workdir = run_config({**tiny, "target": gguf}, tmp_path, "hidden_size = 100")
    one_error_line(invoke(["run", config]), "--hidden-size 100", "--hidden-size 96 or 112")
    assert not workdir.exists() and not (tmp_path / "cache" / "gguf").exists()


def test_eyas_run_names_an_option_a_stage_requires_that_the_config_leaves_out(tiny, tmp_path):
    workdir = tmp_path / "work"
    config = tmp_path / "run.toml"
    config.write_text(f'target = "{tiny["target"]}"\nworkdir = "{workdir}"\nstages = ["prepare", "train"]\n')
    one_error_line(invoke(["run", config]), "[prepare]", "'data' is required")
    assert not workdir.exists()


def test_a_checkpoint_records_how_many_positions_its_run_learned_from(tiny, tmp_path):
    """The checkpoint's count of learned positions travels with its other totals (a resume keeps counting)."""
    run = tmp_path / "run"
    result = invoke(["train", "--target", tiny["target"], "--data", tiny["data"], "--out", run, "--max-steps", "1",
                     "--ttt-steps", "2", "--checkpoint-every", "1"])
    assert result.exit_code == 0, result.output
    state = json.loads((run / "checkpoints" / "step-00000001" / "state.json").read_text())
    assert state["counted"] > 0


def test_a_holdout_with_nothing_to_judge_says_so_instead_of_a_loss_of_zero(monkeypatch):
    """A holdout whose samples hold no position the drafter can be judged on (every one shorter than a block, say)
    evaluates to loss 0 and τ 1.00, which would read as a result: eyas train says nothing was evaluated."""
    from types import SimpleNamespace

    from rich.console import Console

    import eyas.train.trainer
    from eyas import stages

    empty = {"loss": 0.0, "accuracy": [0.0], "acceptance_cumulative": [0.0], "tau": 1.0, "positions": 0.0}
    judged = {**empty, "loss": 2.5, "tau": 1.4, "acceptance_cumulative": [0.4], "positions": 12.0}
    for evaluation, says in ((empty, "nothing evaluated: no held-out sample"), (judged, "loss 2.500 → 2.500")):
        report = SimpleNamespace(stopped_by=None, initial_eval=evaluation, final_eval=evaluation, steps=1, tokens=10,
                                 seconds=0.1)
        monkeypatch.setattr(eyas.train.trainer, "train", lambda options, r=report: r)
        console = Console(record=True, width=400)
        stages._train(SimpleNamespace(out="RUN"), console)
        printed = console.export_text()
        assert says in printed and ("τ 1.00 → 1.00" not in printed or evaluation is judged), printed
