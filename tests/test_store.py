"""The feature store: exact contents, fp8, disk planning, checks (kill -9 then resume: test_kill_resume.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zoo
from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.errors import EyasError
from eyas.store.check import check_store
from eyas.store.reader import FeatureStore
from eyas.target import capture_hidden_states, discover_layout


@pytest.fixture(scope="module")
def target_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    return zoo.save_tiny_target(root / "target"), zoo.write_data_dir(root / "data")


def options(target, data, out, **overrides):
    # Small shards (one or two batches each) so a kill lands between, and inside, many shard writes.
    base = dict(target=target, data=Path(data), out=Path(out), dtype="fp32", token_budget=200, max_batch=4, shard_mb=1)
    return CaptureOptions(**{**base, **overrides})


def test_store_holds_each_sample_once_with_its_exact_states(target_and_data, tmp_path):
    target, data = target_and_data
    report = capture(options(target, data, tmp_path / "f", shard_mb=0))  # shard_mb 0 → one batch per shard
    assert report.shards_written > 5
    model = zoo.llama()
    layout = discover_layout(model)
    store = FeatureStore(tmp_path / "f", "train")
    assert sorted(store.sample_ids) == sorted(f"train-{i}" for i in range(24)) and len(store) == 24
    for i in range(len(store)):
        item = store[i]
        alone = capture_hidden_states(model, layout, item["input_ids"].long())
        # Batched with padding vs alone: equal up to fp32 summation order.
        torch.testing.assert_close(item["aux"], alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["final"], alone.final[0], rtol=1e-5, atol=1e-5)
        assert item["input_ids"].dtype == torch.int32 and item["loss_mask"].dtype == torch.uint8
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["layer_ids"] == [2, 4, 5] and "entering decoder layer" in manifest["layer_id_convention"]
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    assert len(FeatureStore(tmp_path / "f", "holdout")) == 4
    assert capture(options(target, data, tmp_path / "f", shard_mb=0)).already_complete


def test_fp8_halves_the_bytes_with_bounded_error(target_and_data, tmp_path):
    target, data = target_and_data
    capture(options(target, data, tmp_path / "bf16", dtype="bf16", shard_mb=1024))
    capture(options(target, data, tmp_path / "fp8", dtype="fp8", shard_mb=1024))
    capture(options(target, data, tmp_path / "fp32", dtype="fp32", shard_mb=1024))
    sizes = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*-[0-9]*.safetensors")) for d in ("bf16", "fp8")}  # the shards
    state_bytes = {d: sum(t.numel() * t.element_size() for f in (tmp_path / d).glob("*-[0-9]*.safetensors")
                          for name, t in load_file(f).items() if name in ("aux", "final")) for d in ("bf16", "fp8")}
    assert state_bytes["fp8"] * 2 == state_bytes["bf16"]
    assert sizes["fp8"] < 0.56 * sizes["bf16"]  # scales, ids and masks add a little
    exact, quantized = FeatureStore(tmp_path / "fp32"), FeatureStore(tmp_path / "fp8", dtype=torch.float32)
    worst = 0.0
    for i in range(len(exact)):
        a, b = exact[i], quantized[i]
        assert a["id"] == b["id"]
        for name in ("aux", "final"):
            ref = a[name].reshape(a[name].shape[0], -1, 64)
            got = b[name].reshape(ref.shape)
            rel = ((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()  # per token and layer
            worst = max(worst, rel)
    print(f"fp8 round trip: max relative error per token-layer {worst:.4f} (file bytes {sizes['fp8'] / sizes['bf16']:.3f} of bf16)")
    assert worst < 0.07  # e4m3 keeps 3 mantissa bits: ≤ 1/16 relative rounding of the largest value


def test_disk_planning_refuses_when_short_and_max_gb_caps(target_and_data, tmp_path, monkeypatch):
    target, data = target_and_data
    import eyas.capture.stage as stage

    monkeypatch.setattr(stage.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(EyasError, match=r"not enough disk(.|\n)*--max-gb"):
        capture(options(target, data, tmp_path / "short"))
    assert capture(options(target, data, tmp_path / "forced", force=True)).shards_written > 0
    monkeypatch.undo()
    per_token = 4 * 64 * 4 + 5  # aux (3 layers) + final, fp32, plus id and mask
    report = capture(options(target, data, tmp_path / "capped", max_gb=400 * per_token / 2**30))
    assert 0 < report.samples_capped < 28
    assert 300 < report.tokens_written <= 400


def test_rerun_with_other_settings_is_refused(target_and_data, tmp_path):
    target, data = target_and_data
    capture(options(target, data, tmp_path / "f"))
    with pytest.raises(EyasError, match="other inputs or settings.*dtype"):
        capture(options(target, data, tmp_path / "f", dtype="bf16"))
    # the compiled forward rounds differently: one store is captured one way
    with pytest.raises(EyasError, match=r"other inputs or settings \(changed: options.compile_layers\)"):
        capture(options(target, data, tmp_path / "f", compile_layers=False))
    # a store from before the option was captured eagerly: --no-compile-layers continues it
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    del manifest["options"]["compile_layers"]
    (tmp_path / "f" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match=r"changed: options.compile_layers"):
        capture(options(target, data, tmp_path / "f"))
    assert capture(options(target, data, tmp_path / "f", compile_layers=False)).shards_written == 0


def test_check_verifies_checksums_and_recaptures(target_and_data, tmp_path):
    target, data = target_and_data
    capture(options(target, data, tmp_path / "f", dtype="bf16"))
    report = check_store(tmp_path / "f", samples=3)
    assert report.ok and len(report.recaptured) == 3
    assert set(report.tensors) == {"layer 2", "layer 4", "layer 5", "final"}
    assert 0 < max(fit.worst_rounded for fit in report.tensors.values()) < 1e-2  # bf16 rounding, nothing more
    shard = sorted((tmp_path / "f").glob("train-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    broken = check_store(tmp_path / "f", samples=0)
    assert not broken.ok and len(broken.bad_checksums) == 1
    assert broken.bad_checksums[0].startswith(f"{shard.name}: its SHA-256 differs from the manifest's")
