"""Reads that trust their input: each stage verifies what it reads before doing work and refuses in one line that
names the file and what to do — and writes nothing (no RUN_DIR, DRAFT_DIR or REPORT_DIR appears, nothing changes)."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import zoo
from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.cli import app
from eyas.export.stage import export_run
from eyas.manifest import write_manifest
from eyas.train.options import TrainOptions
from eyas.train.trainer import train

STORE = dict(dtype="fp32", token_budget=200, max_batch=4, shard_mb=0)  # one shard per batch: several shards


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> dict:
    """A DATA_DIR (with the output records eyas prepare writes), its FEATURES_DIR, a trained RUN_DIR, its DRAFT_DIR, and
    targets that are not theirs: same config other weights, another width, another vocabulary, fewer layers."""
    root = tmp_path_factory.mktemp("reads")
    target = zoo.save_tiny_target(root / "target")
    data = Path(zoo.write_data_dir(root / "data", sizes=(("train", 10), ("holdout", 2))))
    write_manifest(data, "prepare", {}, [], ["train.parquet", "holdout.parquet", "vocab.safetensors"])
    features = root / "features"
    capture(CaptureOptions(target=target, data=data, out=features, **STORE))
    train(TrainOptions(target=target, out=root / "run", features=features, max_steps=1, token_budget=256, ttt_steps=1,
                       checkpoint_every=1, eval_batches=1))
    export_run(root / "run", root / "draft", dtype="fp32")
    return {"root": root, "target": target, "data": data, "features": features, "run": root / "run",
            "draft": root / "draft",
            "twin": zoo.save_llama(root / "twin", seed=1),  # the same config.json, other weights
            "wider": zoo.save_llama(root / "wider", hidden_size=96, num_attention_heads=4, num_key_value_heads=2),
            "other_vocab": zoo.save_llama(root / "other-vocab", vocab_size=320),
            "shallow": zoo.save_llama(root / "shallow", num_hidden_layers=3)}


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def error_line(result, *names) -> str:
    """The one ``error:`` line of a failed command, which names each of ``names``; no traceback."""
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    for name in names:
        assert str(name) in errors[0], errors[0]
    return errors[0]


def snapshot(directory: Path) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def copy(pipeline, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pipeline[name], tmp_path / name))


def shards(features: Path) -> list[Path]:
    return sorted(features.glob("train-*.safetensors"))


def flip_byte(path: Path, at: int = -10) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def truncate(path: Path, keep: float = 0.6) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def train_args(target, features, out, *more):
    return ["train", "--target", target, "--features", features, "--out", out, "--max-steps", "1", "--token-budget", "256",
            "--ttt-steps", "1", "--eval-batches", "1", "--checkpoint-every", "1", *more]  # the pipeline's run, as made


# 1. eyas train --features: the shards' bytes and the target they were captured from


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
def test_train_refuses_a_store_whose_shards_changed(pipeline, tmp_path, damage):
    features = copy(pipeline, "features", tmp_path)
    shard = shards(features)[1]
    {"flipped": flip_byte, "truncated": truncate, "missing": Path.unlink}[damage](shard)
    result = run(*train_args(pipeline["target"], features, tmp_path / "run"))
    assert result.exit_code == 2
    line = error_line(result, features, shard.name, "rerun the eyas capture command")
    assert {"flipped": "SHA-256 differs", "truncated": "bytes where the manifest records", "missing": "missing"}[damage] in line
    assert not (tmp_path / "run").exists()


def test_no_verify_skips_the_hashes_and_says_so_but_never_reads_a_truncated_shard(pipeline, tmp_path):
    features = copy(pipeline, "features", tmp_path)
    flip_byte(shards(features)[0], at=-4)  # inside the last tensor's data: a changed value, still a valid file
    result = run(*train_args(pipeline["target"], features, tmp_path / "run", "--no-verify"))
    assert result.exit_code == 0, result.output
    assert "--no-verify: not checked: the SHA-256 of" in result.output and (tmp_path / "run" / "manifest.json").is_file()

    truncate(shards(features)[0])
    result = run(*train_args(pipeline["target"], features, tmp_path / "again", "--no-verify"))
    assert result.exit_code == 2
    error_line(result, shards(features)[0].name, "bytes where the manifest records")
    assert not (tmp_path / "again").exists()


def test_train_refuses_a_store_captured_from_another_target(pipeline, tmp_path):
    twin_config = json.loads((Path(pipeline["twin"]) / "config.json").read_text())
    assert twin_config == json.loads((Path(pipeline["target"]) / "config.json").read_text())  # only the weights differ
    result = run(*train_args(pipeline["twin"], pipeline["features"], tmp_path / "run"))
    assert result.exit_code == 2
    error_line(result, pipeline["features"] / "manifest.json", pipeline["target"], pipeline["twin"], "other weights",
               "--no-verify")
    assert not (tmp_path / "run").exists()

    result = run(*train_args(pipeline["wider"], pipeline["features"], tmp_path / "run", "--no-verify"))
    assert result.exit_code == 2  # another width cannot be trained on at all: --no-verify does not help
    line = error_line(result, pipeline["features"] / "manifest.json", "hidden size 64 there, 96 here")
    assert "--no-verify" not in line
    assert not (tmp_path / "run").exists()


def test_a_moved_target_with_the_same_weights_is_the_same_target(pipeline, tmp_path):
    moved = shutil.copytree(pipeline["target"], tmp_path / "moved-target")
    result = run(*train_args(moved, pipeline["features"], tmp_path / "run"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("damage", "says"), [
    ("missing", "manifest.json is missing: not a finished FEATURES_DIR"),
    ("not json", "is not valid JSON"),
    ("newer format", "has format eyas-features/9"),
    ("a data dir", "is a DATA_DIR (written by eyas prepare), not a FEATURES_DIR"),
    ("fields missing", "lacks what a store's manifest holds"),
])
def test_train_refuses_a_features_dir_whose_manifest_is_not_a_stores(pipeline, tmp_path, damage, says):
    features = copy(pipeline, "features", tmp_path)
    manifest = features / "manifest.json"
    if damage == "missing":
        manifest.unlink()
    elif damage == "not json":
        manifest.write_text(manifest.read_text()[:200])
    elif damage == "fields missing":
        manifest.write_text(json.dumps({"format": "eyas-features/1", "shards": []}))
    else:
        recorded = json.loads(manifest.read_text())
        recorded["format"] = "eyas-features/9" if damage == "newer format" else "eyas-data/1"
        manifest.write_text(json.dumps(recorded))
    result = run(*train_args(pipeline["target"], features, tmp_path / "run"))
    assert result.exit_code == 2
    error_line(result, features, says)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("layer_ids", "x", "layer_ids 'x' are not increasing layer ids of a 8-layer target"),
    ("layer_ids", [1, 2, 99], "layer_ids [1, 2, 99] are not increasing layer ids"),  # trained without a word before
    ("target", None, "target, data and options must be JSON objects"),
    ("options", [], "target, data and options must be JSON objects"),
    ("dtype", "fp7", "dtype 'fp7' is none of bf16, fp32"),
    ("shards", "bytes", "has bytes of the wrong kind"),
])
def test_a_store_manifest_with_a_field_of_the_wrong_kind_is_one_line(pipeline, tmp_path, field, value, says):
    features = copy(pipeline, "features", tmp_path)
    recorded = json.loads((features / "manifest.json").read_text())
    if field == "shards":
        recorded["shards"][0]["bytes"] = "big"
    else:
        recorded[field] = value
    (features / "manifest.json").write_text(json.dumps(recorded))
    result = run(*train_args(pipeline["target"], features, tmp_path / "run"))
    error_line(result, features / "manifest.json", says, "rerun the eyas capture command")
    assert result.exit_code == 2 and not (tmp_path / "run").exists()


# 2. eyas check DRAFT_DIR: damaged weights, with and without eyas' manifest; --target of another shape


def check_errors(result) -> list[str]:
    assert "Traceback" not in result.output, result.output
    return [line for line in result.output.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("manifest", [True, False], ids=["eyas-export", "another-tool"])
def test_check_fails_on_truncated_weights(pipeline, tmp_path, manifest):
    draft = copy(pipeline, "draft", tmp_path)
    if not manifest:
        (draft / "manifest.json").unlink()
    truncate(draft / "model.safetensors")
    result = run("check", draft)
    assert result.exit_code == 1
    [line] = check_errors(result)
    assert str(draft / "model.safetensors") in line
    assert ("bytes where the manifest records" if manifest else "truncated") in line


def test_check_fails_on_changed_weight_bytes(pipeline, tmp_path):
    draft = copy(pipeline, "draft", tmp_path)
    flip_byte(draft / "model.safetensors", at=-3)
    result = run("check", draft)
    assert result.exit_code == 1
    [line] = check_errors(result)
    assert str(draft / "model.safetensors") in line and "SHA-256 differs" in line and "export it again" in line

    (draft / "manifest.json").unlink()  # another tool's drafter: no checksum, but a NaN is still caught
    tensors = load_file(draft / "model.safetensors")
    tensors["norm.weight"][3] = float("nan")
    save_file(tensors, str(draft / "model.safetensors"))
    result = run("check", draft)
    assert result.exit_code == 1
    assert any("tensor norm.weight holds 1 NaN or Inf values" in line for line in check_errors(result))


def test_check_given_another_target_names_what_does_not_fit(pipeline, tmp_path):
    assert run("check", pipeline["draft"], "--target", pipeline["target"]).exit_code == 0
    cases = {"wider": "reads target states 64 wide", "other_vocab": "its vocab_size is 256, the target's 320",
             "shallow": "the engines tap (2, N//2, N-3), which a 3-layer target does not have"}
    for name, says in cases.items():
        result = run("check", pipeline["draft"], "--target", pipeline[name])
        assert result.exit_code == 1, name
        assert any("made for another target" in line and says in line for line in check_errors(result)), result.output
    draft = copy(pipeline, "draft", tmp_path)
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 9]
    (draft / "config.json").write_text(json.dumps(config))
    result = run("check", draft, "--target", pipeline["target"])
    assert result.exit_code == 1
    assert any("fall outside 0..8" in line for line in check_errors(result))
    assert "config.json: " in result.output and "edited after eyas export wrote it?" in result.output  # a warning


# 3. eyas capture --check: a missing or truncated shard is a failed check, one line per shard, no crash


def test_capture_check_reports_each_bad_shard_and_the_advice_repairs_it(pipeline, tmp_path):
    features = copy(pipeline, "features", tmp_path)
    first, second = shards(features)[:2]
    truncate(first)
    second.unlink()
    before = snapshot(features)
    result = run("capture", "--check", features, "--check-samples", "0")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = [line.strip() for line in result.output.splitlines() if line.strip().startswith(("train-", "holdout-"))]
    assert len(lines) == 2, result.output
    assert lines[0].startswith(f"{first.name}: ") and "truncated" in lines[0]
    assert lines[1].startswith(f"{second.name}: missing")
    assert all("rerun the eyas capture command that made the store" in line for line in lines)
    assert snapshot(features) == before  # a check writes nothing

    first.unlink()  # what the advice says: delete the bad shard, rerun the capture
    report = capture(CaptureOptions(target=pipeline["target"], data=pipeline["data"], out=features, **STORE))
    assert report.shards_written == 2 and not report.already_complete
    assert run("capture", "--check", features, "--check-samples", "1").exit_code == 0
    repaired, original = snapshot(features), snapshot(pipeline["features"])
    assert repaired.pop(Path("manifest.json")) and original.pop(Path("manifest.json"))  # (its time and --out differ)
    assert repaired == original  # the very same shards and vocabulary as before the damage
    assert json.loads((features / "manifest.json").read_text())["shards"] == \
        json.loads((pipeline["features"] / "manifest.json").read_text())["shards"]


def test_capture_check_of_a_directory_that_is_no_store(pipeline, tmp_path):
    result = run("capture", "--check", pipeline["data"])
    assert result.exit_code == 2
    error_line(result, pipeline["data"], "is a DATA_DIR")
    result = run("capture", "--check", tmp_path / "nowhere")
    assert result.exit_code == 2
    error_line(result, tmp_path / "nowhere", "does not exist")


# 4. eyas bench and eyas generate: a drafter made for another target fails before the target is loaded


@pytest.fixture
def no_target_loading(monkeypatch):
    import eyas.target.loading

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the drafter was checked")

    monkeypatch.setattr(eyas.target.loading, "load_target", refuse)


def bench_args(target, draft, out):
    return ["bench", "--target", target, "--draft", draft, "--out", out, "--dataset", "mt-bench", "--prompts", "1",
            "--max-new-tokens", "2", "--mode", "chain:2", "--device", "cpu"]


@pytest.mark.parametrize(("target", "says"), [("wider", "reads target states 64 wide"),
                                               ("other_vocab", "vocab_size is 256, the target's 320"),
                                               ("shallow", "which a 3-layer target does not have")])
def test_bench_and_generate_refuse_a_drafter_for_another_target(pipeline, tmp_path, no_target_loading, target, says):
    result = run(*bench_args(pipeline[target], pipeline["draft"], tmp_path / "report"))
    assert result.exit_code == 2
    error_line(result, pipeline["draft"] / "config.json", pipeline[target], says)
    assert not (tmp_path / "report").exists()
    result = run("generate", "--target", pipeline[target], "--draft", pipeline["draft"], "--device", "cpu", "hello")
    assert result.exit_code == 2
    error_line(result, pipeline["draft"] / "config.json", says)


def test_bench_and_generate_refuse_damaged_drafters_and_layer_ids_out_of_range(pipeline, tmp_path, no_target_loading):
    truncated = copy(pipeline, "draft", tmp_path)
    truncate(truncated / "model.safetensors")
    result = run(*bench_args(pipeline["target"], truncated, tmp_path / "report"))
    assert result.exit_code == 2
    error_line(result, truncated / "model.safetensors", "export it again")
    assert not (tmp_path / "report").exists()

    far = tmp_path / "far"
    shutil.copytree(pipeline["draft"], far)
    config = json.loads((far / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 12]
    (far / "config.json").write_text(json.dumps(config))
    result = run("generate", "--target", pipeline["target"], "--draft", far, "--device", "cpu", "hello")
    assert result.exit_code == 2
    error_line(result, far / "config.json", "fall outside 0..8")

    (far / "config.json").write_text("{not json")
    result = run(*bench_args(pipeline["target"], far, tmp_path / "report"))
    assert result.exit_code == 2
    error_line(result, far / "config.json", "not valid JSON")
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("draft_vocab_size", -1, "config field draft_vocab_size is -1: a positive whole number"),
    ("eagle_config", 5, "config field eagle_config is 5: an object"),
    ("eagle_aux_hidden_state_layer_ids", "x", "eagle_aux_hidden_state_layer_ids is 'x': a list of layer ids"),
    ("hidden_size", 64.5, "config field hidden_size is 64.5"),
])
def test_a_drafter_config_field_of_the_wrong_kind_is_one_line_in_generate_and_check(pipeline, tmp_path,
                                                                                    no_target_loading, field, value, says):
    draft = copy(pipeline, "draft", tmp_path)
    config = json.loads((draft / "config.json").read_text())
    config[field] = value  # a hand edit: config.json may be edited after export (check warns of it)
    (draft / "config.json").write_text(json.dumps(config))
    result = run("generate", "--target", pipeline["target"], "--draft", draft, "--device", "cpu", "hello")
    error_line(result, draft / "config.json", says)
    result = run("check", draft)
    assert result.exit_code == 1 and "Traceback" not in result.output and says in result.output, result.output


# Other reads: DATA_DIR for capture, RUN_DIR for export


def test_capture_refuses_a_changed_or_foreign_data_dir(pipeline, tmp_path):
    data = copy(pipeline, "data", tmp_path)
    flip_byte(data / "train.parquet", at=200)
    args = ["capture", "--target", pipeline["target"], "--data", data, "--out", tmp_path / "features", "--dtype", "fp32"]
    result = run(*args)
    assert result.exit_code == 2
    error_line(result, data / "train.parquet", "SHA-256 differs", "rerun the eyas prepare command")
    assert not (tmp_path / "features").exists()

    args[4] = pipeline["features"]  # a FEATURES_DIR where a DATA_DIR belongs
    result = run(*args)
    assert result.exit_code == 2
    error_line(result, pipeline["features"], "is a FEATURES_DIR (written by eyas capture), not a DATA_DIR")
    assert not (tmp_path / "features").exists()


@pytest.mark.parametrize(("damage", "says"), [
    (lambda outputs: "x", "its outputs are not a list of file records"),
    (lambda outputs: [{"file": 5}], 'the output record {"file": 5} is damaged'),
    (lambda outputs: [{**outputs[0], "bytes": "x"}], "is damaged"),
    (lambda outputs: [{**outputs[0], "file": "../../elsewhere"}], "is damaged"),  # never read outside DATA_DIR
], ids=["not-a-list", "file-a-number", "bytes-a-string", "outside"])
def test_capture_refuses_a_data_dir_whose_output_records_are_damaged(pipeline, tmp_path, damage, says):
    data = copy(pipeline, "data", tmp_path)
    recorded = json.loads((data / "manifest.json").read_text())
    recorded["outputs"] = damage(recorded["outputs"])
    (data / "manifest.json").write_text(json.dumps(recorded))
    result = run("capture", "--target", pipeline["target"], "--data", data, "--out", tmp_path / "features")
    error_line(result, data / "manifest.json", says, "rerun the eyas prepare command")
    assert result.exit_code == 2 and not (tmp_path / "features").exists()


@pytest.mark.parametrize(("damage", "says"), [
    (lambda run: (run / "train_options.json").write_text("[]"), "train_options.json holds no JSON object"),
    (lambda run: (run / "train_options.json").write_text(
        json.dumps({**json.loads((run / "train_options.json").read_text()), "segments": 5})), "its segments are not a list"),
    (lambda run: (run / "checkpoints" / "step-00000001" / "state.json").write_text("{}"), "is not a checkpoint's state"),
    (lambda run: (run / "checkpoints" / "step-00000001" / "state.json").write_text("{\"st"), "state.json cannot be read"),
], ids=["record-not-an-object", "segments", "state-fields", "state-not-json"])
def test_a_resume_from_a_damaged_run_record_or_checkpoint_is_one_line(pipeline, tmp_path, damage, says):
    run_dir = copy(pipeline, "run", tmp_path)
    damage(run_dir)
    before = snapshot(run_dir)
    result = run(*train_args(pipeline["target"], pipeline["features"], run_dir, "--resume"))
    error_line(result, run_dir, says, "--force")
    assert result.exit_code == 2 and snapshot(run_dir) == before


def test_a_resume_reads_past_a_damaged_pointer_and_a_cut_metrics_line(pipeline, tmp_path):
    """latest.json is written atomically and metrics.jsonl a line at a time: damaged by hand or cut by a crash, the
    newest complete checkpoint is the latest and a line that holds no step's record is no record."""
    run_dir = copy(pipeline, "run", tmp_path)
    (run_dir / "checkpoints" / "latest.json").write_text("{")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"ste')
    result = run("train", "--target", pipeline["target"], "--features", pipeline["features"], "--out", run_dir,
                 "--max-steps", "2", "--token-budget", "256", "--ttt-steps", "1", "--eval-batches", "1",
                 "--checkpoint-every", "1", "--resume")
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert steps == sorted(set(steps)) and steps[-1] == 2


def test_export_refuses_a_run_whose_final_weights_changed(pipeline, tmp_path):
    run_dir = copy(pipeline, "run", tmp_path)
    flip_byte(run_dir / "final" / "model.safetensors", at=-5)
    result = run("export", run_dir, "--out", tmp_path / "draft")
    assert result.exit_code == 2
    error_line(result, run_dir / "final" / "model.safetensors", "--resume")
    assert not (tmp_path / "draft").exists()

    result = run(*train_args(pipeline["target"], pipeline["features"], run_dir, "--resume"))  # what the advice says
    assert result.exit_code == 0, result.output
    assert (run_dir / "final" / "model.safetensors").read_bytes() == \
        (pipeline["run"] / "final" / "model.safetensors").read_bytes()
    assert run("export", run_dir, "--out", tmp_path / "draft").exit_code == 0
