"""Every stage directory describes itself (manifest.json) and stands alone: moved elsewhere, with its inputs' original
places gone, it still serves every later stage."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import eyas
import zoo
from eyas.bench.stage import BenchOptions, bench_stage
from eyas.capture.stage import CaptureOptions, capture
from eyas.cli import app
from eyas.data.prepare import AlreadyPrepared, PrepareOptions, prepare
from eyas.errors import EyasError
from eyas.export.check import check_draft_dir
from eyas.export.stage import export_run
from eyas.manifest import COMMON_FIELDS, FORMATS, git_commit
from eyas.store.check import check_store
from eyas.train.trainer import TrainOptions, train


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / "manifest.json").read_text())


def conversations(path: Path) -> Path:
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"What is {i} times {i}?"},
                                              {"from": "gpt", "value": f"It is {i * i}, since {i} x {i} = {i * i}."}]}
            for i in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def prepare_into(target: str, source: Path, out: Path) -> Path:
    prepare(PrepareOptions(target=target, data=[str(source)], out=out, max_length=64, holdout=0.2, draft_vocab_size=300))
    return out


def capture_into(target: str, data: Path, out: Path) -> Path:
    capture(CaptureOptions(target=target, data=data, out=out, dtype="fp32", token_budget=256, max_batch=4, shard_mb=0))
    return out


def train_into(target: str, features: Path, out: Path) -> Path:
    train(TrainOptions(target=target, out=out, features=features, max_steps=2, token_budget=256, ttt_steps=2,
                       checkpoint_every=2, eval_batches=1))
    return out


def bench_args(target: str, draft: Path, data: Path, out: Path) -> list[str]:
    return ["bench", "--target", target, "--draft", str(draft), "--out", str(out), "--dataset", "sharegpt-holdout",
            "--data", str(data), "--mode", "chain:2", "--prompts", "1", "--max-new-tokens", "4", "--device", "cpu",
            "--temperature", "0"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(zoo.save_chat_target(tmp_path_factory.mktemp("manifest-target")))


@pytest.fixture(scope="module")
def stages(tmp_path_factory, target) -> dict[str, Path]:
    """Every stage once, in place: stage name → its directory."""
    root = tmp_path_factory.mktemp("stages")
    data = prepare_into(target, conversations(root / "chats.jsonl"), root / "data")
    features = capture_into(target, data, root / "features")
    run = train_into(target, features, root / "run")
    draft = export_run(run, root / "draft", dtype="fp32")
    bench_stage(BenchOptions(target=target, draft=draft, out=root / "report", datasets=("sharegpt-holdout",), data=data,
                             modes="chain:2", prompts=1, max_new_tokens=4, device="cpu"), show_progress=False)
    return {"prepare": data, "capture": features, "train": run, "export": draft, "bench": root / "report"}


def test_moved_stage_directories_still_train_offline_export_and_bench(target, tmp_path, monkeypatch):
    import eyas.target.loading

    first, moved = tmp_path / "first", tmp_path / "moved"
    data = prepare_into(target, conversations(tmp_path / "chats.jsonl"), first / "data")
    features = capture_into(target, data, first / "features")
    before = train_into(target, features, first / "run")
    moved.mkdir()
    for name in ("data", "features"):
        shutil.move(first / name, moved / name)
    assert not data.exists() and not features.exists()

    again = train_into(target, moved / "features", first / "again")  # the vocabulary now comes from FEATURES_DIR
    a, b = load_file(before / "final" / "model.safetensors"), load_file(again / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same vocabulary, same data: same drafter
    shutil.move(again, moved / "run")
    assert not again.exists()

    def no_target_config(*args, **kwargs):
        raise AssertionError("export loaded the target's config instead of reading RUN_DIR")

    with monkeypatch.context() as patch:
        patch.setattr(eyas.target.loading, "load_target_config", no_target_config)
        draft = export_run(moved / "run", moved / "draft", dtype="fp32")
    assert check_draft_dir(draft).ok
    config = json.loads((draft / "config.json").read_text())
    assert config["draft_vocab_size"] == 300 and config["vocab_size"] == 49152

    result = CliRunner().invoke(app, bench_args(target, draft, moved / "data", moved / "report"))
    assert result.exit_code == 0, result.output
    report = json.loads((moved / "report" / "report.json").read_text())
    assert [(r["dataset"], r["prompts"]) for r in report["rows"]] == [("sharegpt-holdout", 1)]


def test_every_stage_manifest_has_the_common_fields_and_its_inputs_digests(stages):
    expected_inputs = {"prepare": {}, "capture": {"data": "prepare"}, "train": {"features": "capture"},
                       "export": {"run": "train"}, "bench": {"draft": "export", "data": "prepare"}}
    config_digest = manifest(stages["capture"])["target"]["config_sha256"]
    for stage, directory in stages.items():
        recorded = manifest(directory)
        assert set(COMMON_FIELDS) <= set(recorded), stage
        assert recorded["format"] == FORMATS[stage] and recorded["stage"] == stage
        assert recorded["eyas_version"] == eyas.__version__ and recorded["git_commit"] == git_commit()
        assert recorded["created"].endswith("Z")
        out = recorded["options"].get("out")
        assert out == str(directory), stage  # the stage's own options, JSON-ready
        inputs = {i["role"]: i for i in recorded["inputs"]}
        assert inputs["target"]["sha256"] == config_digest, stage  # one target, identified the same by every stage
        for role, source in expected_inputs[stage].items():
            assert inputs[role]["path"] == str(stages[source]), (stage, role)
            assert inputs[role]["sha256"] == sha(stages[source] / "manifest.json"), (stage, role)
        assert recorded["outputs"], stage
        for output in recorded["outputs"]:
            path = directory / output["file"]
            assert output["bytes"] == path.stat().st_size and output["sha256"] == sha(path), (stage, output["file"])
    assert {o["file"] for o in manifest(stages["export"])["outputs"]} == {"config.json", "model.safetensors", "README.md"}
    assert {"report.json", "report.md", "acceptance.png"} == {o["file"] for o in manifest(stages["bench"])["outputs"]}


def test_features_dir_carries_its_vocabulary_and_run_dir_the_target_facts(stages):
    features, run = stages["capture"], stages["train"]
    assert (features / "vocab.safetensors").read_bytes() == (stages["prepare"] / "vocab.safetensors").read_bytes()
    assert manifest(features)["outputs"] == [{"file": "vocab.safetensors", "bytes": (features / "vocab.safetensors").stat().st_size,
                                             "sha256": sha(features / "vocab.safetensors")}]
    facts = json.loads((run / "target.json").read_text())
    assert facts["model_type"] == "llama" and facts["num_layers"] == zoo.LAYERS and facts["spec"] == manifest(run)["options"]["target"]
    assert facts["layer_ids"] == manifest(features)["layer_ids"] == [2, 4, 5]
    assert manifest(stages["export"])["target"] == facts


def test_git_commit_is_the_checkouts_and_none_without_git(monkeypatch):
    monkeypatch.delenv("EYAS_COMMIT", raising=False)
    root = Path(eyas.__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    git_commit.cache_clear()
    assert git_commit() == head
    monkeypatch.setenv("PATH", "")  # git is not installed
    git_commit.cache_clear()
    try:
        assert git_commit() is None
    finally:
        git_commit.cache_clear()


def test_the_commit_the_environment_names_comes_first(tmp_path):
    """A device machine gets a copy of the source tree without .git, or with another commit's: EYAS_COMMIT names the
    tree's commit (hex only; anything else is not a commit), in a checkout too."""
    shutil.copytree(Path(eyas.__file__).resolve().parent, tmp_path / "src" / "eyas",
                    ignore=shutil.ignore_patterns("__pycache__"))
    ask = "from eyas.manifest import git_commit; print(git_commit())"
    for named, recorded in (("92664AE", "92664ae"), ("not-a-commit", "None"), ("", "None")):
        env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "EYAS_COMMIT": named}
        done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
        assert done.stdout.strip() == recorded
    checkout = Path(eyas.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "EYAS_COMMIT": "abc1234"}
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "abc1234"


def test_capture_resumes_into_a_store_whose_data_dir_moved_and_refuses_other_data(target, tmp_path):
    data = prepare_into(target, conversations(tmp_path / "chats.jsonl"), tmp_path / "data")
    features = capture_into(target, data, tmp_path / "features")
    complete = manifest(features)
    # Make it a store interrupted after all but its last shard: a rank's partial manifest, no final one.
    partial = {**complete, "complete": False, "shards": complete["shards"][:-1], "outputs": []}
    (features / "manifest.rank0.json").write_text(json.dumps(partial))
    (features / "manifest.json").unlink()
    (features / complete["shards"][-1]["file"]).unlink()
    shutil.move(data, tmp_path / "elsewhere")

    report = capture(CaptureOptions(target=target, data=tmp_path / "elsewhere", out=features, dtype="fp32", token_budget=256,
                                    max_batch=4, shard_mb=0))
    assert report.shards_skipped == len(complete["shards"]) - 1 and report.shards_written == 1
    assert [s["sha256"] for s in manifest(features)["shards"]] == [s["sha256"] for s in complete["shards"]]
    assert (features / "vocab.safetensors").is_file()

    other = tmp_path / "elsewhere" / "manifest.json"
    other.write_text(other.read_text().replace('"max_length": 64', '"max_length": 65'))
    with pytest.raises(EyasError, match="other inputs or settings.*data"):
        capture(CaptureOptions(target=target, data=tmp_path / "elsewhere", out=features, dtype="fp32", token_budget=256,
                               max_batch=4, shard_mb=0))


def test_capture_check_after_data_dir_moved_says_what_it_skipped(stages, tmp_path):
    from rich.console import Console

    from eyas.store.check import print_check

    features = shutil.copytree(stages["capture"], tmp_path / "features")
    store = manifest(features)
    store["data"]["path"] = str(tmp_path / "gone")  # captured from a DATA_DIR that has moved since
    (features / "manifest.json").write_text(json.dumps(store))
    report = check_store(features, samples=2)
    assert report.ok and len(report.recaptured) == 2 and not report.count_problems
    assert len(report.skipped) == 1 and str(tmp_path / "gone") in report.skipped[0] and "is gone" in report.skipped[0]
    console = Console(record=True, width=200)
    print_check(console, report)
    assert "skipped: sample ids not compared with DATA_DIR" in console.export_text()

    shard = features / store["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    [bad] = check_store(features, samples=0).bad_checksums
    assert bad.startswith(f"{shard.name}: its SHA-256 differs from the manifest's")


def test_a_store_made_before_stores_carried_a_vocabulary(stages, target, tmp_path):
    """It trains while its DATA_DIR is where the capture recorded it; once that is gone, training says what to do,
    and rerunning the capture command adds the vocabulary without capturing again."""
    data = shutil.copytree(stages["prepare"], tmp_path / "data")
    features = capture_into(target, data, tmp_path / "features")
    old = manifest(features)
    old["outputs"] = []
    (features / "manifest.json").write_text(json.dumps(old))
    (features / "vocab.safetensors").unlink()
    assert train_into(target, features, tmp_path / "run-a").joinpath("final", "model.safetensors").is_file()
    shutil.move(data, tmp_path / "moved")
    with pytest.raises(EyasError, match=r"holds no draft vocabulary(.|\n)*is gone(.|\n)*rerun the same eyas capture"):
        train_into(target, features, tmp_path / "run-b")
    report = capture(CaptureOptions(target=target, data=tmp_path / "moved", out=features, dtype="fp32", token_budget=256,
                                    max_batch=4, shard_mb=0))
    assert report.already_complete and report.shards_written == 0
    assert sha(features / "vocab.safetensors") == sha(tmp_path / "moved" / "vocab.safetensors")
    assert train_into(target, features, tmp_path / "run-c").joinpath("final", "model.safetensors").is_file()


def test_export_of_a_run_without_target_facts_loads_the_target_config(stages, tmp_path, monkeypatch):
    import eyas.target.loading

    run = shutil.copytree(stages["train"], tmp_path / "run")
    (run / "target.json").unlink()
    (run / "manifest.json").unlink()  # runs made before target.json had no manifest either (it would list target.json)
    loaded = []
    real = eyas.target.loading.load_target_config
    monkeypatch.setattr(eyas.target.loading, "load_target_config", lambda *a, **k: loaded.append(a[0]) or real(*a, **k))
    draft = export_run(run, tmp_path / "draft", dtype="fp32")
    assert loaded == [manifest(stages["train"])["options"]["target"]]
    for name in ("config.json", "model.safetensors"):
        assert (draft / name).read_bytes() == (stages["export"] / name).read_bytes(), name


def test_prepare_recognises_its_data_dir_in_the_older_manifest_layout(stages, target, tmp_path):
    data = shutil.copytree(stages["prepare"], tmp_path / "data")
    recorded = manifest(data)
    source = recorded["sources"][0]
    older = {k: v for k, v in recorded.items() if k not in ("fingerprint", "options")}
    older.update(recorded["fingerprint"])  # fingerprint fields at the top level, options = the fingerprinted ones
    (data / "manifest.json").write_text(json.dumps(older))
    with pytest.raises(AlreadyPrepared):
        prepare(PrepareOptions(target=target, data=[source], out=data, max_length=64, holdout=0.2, draft_vocab_size=300))
