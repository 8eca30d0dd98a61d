"""Issue 23's rehearsal path at reduced widths: the Kimi-K2.5-shaped random target (61 layers, MLA, layer 0 dense,
shared + routed experts, the language_model wrapper) → capture bf16 and fp8 → offline training → export → check;
and the drafter's FLOP formula that MFU divides by, against torch's own count."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.data.synthetic import write_random_data_dir
from eyas.families.eagle3.config import drafter_config_from_target
from eyas.families.eagle3.flops import training_flops
from eyas.families.eagle3.model import Eagle3Drafter
from eyas.families.eagle3.ttt import ttt_steps
from eyas.export.check import check_draft_dir
from eyas.export.stage import export_run
from eyas.store.reader import FeatureStore
from eyas.store.shards import bytes_per_token
from eyas.target.rehearsal import build_rehearsal_target, kimi_text_config, loaded_target, save_head_dir
from eyas.train.options import TrainOptions
from eyas.train.trainer import train


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    root = tmp_path_factory.mktemp("rehearsal")
    model = build_rehearsal_target("cpu", torch.float32, seed=0, reduced=True)
    spec = save_head_dir(model, root / "target")
    data = write_random_data_dir(root / "data", vocab_size=2048, draft_vocab_size=256,
                                 samples={"train": 10, "holdout": 3}, lengths=(16, 40))
    stores = {}
    for dtype in ("bf16", "fp8"):
        stores[dtype] = root / f"features-{dtype}"
        capture(CaptureOptions(target=spec, data=data, out=stores[dtype], dtype=dtype, token_budget=2048, shard_mb=1,
                               writer_threads=1), loaded=loaded_target(model, spec))
    return {"root": root, "model": model, "spec": spec, "data": data, "stores": stores}


def test_same_seed_same_weights_and_the_wrapper_layout_is_kimis():
    from eyas.target.layout import discover_layout

    one, two = (build_rehearsal_target("cpu", torch.float32, seed=0, reduced=True) for _ in range(2))
    other = build_rehearsal_target("cpu", torch.float32, seed=1, reduced=True)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True))
    assert not torch.equal(one.language_model.lm_head.weight, other.language_model.lm_head.weight)
    layout = discover_layout(one)  # the vision tower has 61 blocks too: the stack beside the embedding wins
    assert (layout.layers_path, layout.norm_path, layout.num_layers) == ("language_model.model.layers",
                                                                         "language_model.model.norm", 61)
    layers = one.language_model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP" and type(layers[1].mlp).__name__ == "DeepseekV3MoE"
    full = kimi_text_config()
    assert (full.hidden_size, full.vocab_size, full.q_lora_rank, full.kv_lora_rank, full.qk_nope_head_dim,
            full.qk_rope_head_dim, full.v_head_dim, full.num_attention_heads) == (7168, 163840, 1536, 512, 128, 64, 128, 64)


def test_capture_stores_the_wrapped_targets_states_in_bf16_and_fp8(rehearsal):
    model = rehearsal["model"]
    bf16, fp8 = (FeatureStore(rehearsal["stores"][d], "train") for d in ("bf16", "fp8"))
    assert bf16.manifest.layer_ids == [2, 30, 58]  # Kimi-K2.5's default taps (61 layers)
    assert bf16.manifest.target["architecture"] == "RehearsalForConditionalGeneration"
    item = bf16[0]
    with torch.no_grad():
        out = model(input_ids=item["input_ids"].long()[None], output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in (2, 30, 58)], dim=-1)
    torch.testing.assert_close(item["aux"].float(), expected, rtol=2e-2, atol=1e-2)
    final = fp8[0]["final"].float()
    torch.testing.assert_close(final, bf16[0]["final"].float(), rtol=0.1, atol=0.05)  # e4m3 with per-token scales
    sizes = {d: sum(p.stat().st_size for p in rehearsal["stores"][d].glob("*-[0-9]*.safetensors")) for d in ("bf16", "fp8")}
    tokens = sum(s.tokens for s in bf16.manifest.shards)  # both splits, one shard each
    for dtype, size in sizes.items():  # the disk plan's bytes per token is what the shards hold (headers aside)
        assert size / tokens == pytest.approx(bytes_per_token(64, 3, dtype), rel=0.02)


def test_offline_training_from_fp8_then_export_and_check(rehearsal):
    run, draft = rehearsal["root"] / "run", rehearsal["root"] / "draft"
    report = train(TrainOptions(target=rehearsal["spec"], features=rehearsal["stores"]["fp8"], out=run, max_steps=3,
                                token_budget=512, ttt_steps=3, checkpoint_every=100, eval_batches=1, warmup_ratio=0.0))
    assert report.steps == 3 and report.tokens > 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "step_loss" in r]
    assert len(losses) == 3 and torch.isfinite(torch.tensor(losses)).all()
    export_run(run, draft)
    result = check_draft_dir(draft)
    assert result.ok, result.errors
    config = json.loads((draft / "config.json").read_text())
    assert config["draft_vocab_size"] == 256 and config["hidden_size"] == 64
    assert config["eagle_config"]["use_aux_hidden_state"] is True


def test_an_mla_targets_drafter_has_the_published_kimi_layout_not_its_rope_head():
    """transformers reports an MLA config's head_dim as its RoPE part (64); a drafter head takes the value width (128):
    the layout of SpecForge's Kimi-K2.5 drafter (../shared/reference/serving-engines.md §4)."""
    full = kimi_text_config()
    assert full.head_dim == full.qk_rope_head_dim == 64  # what the target reports
    config = drafter_config_from_target(full, [2, 30, 58], 32000)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.draft_vocab_size) == (7168, 64, 64, 128, 18432, 32000)
    with torch.device("meta"):
        drafter = Eagle3Drafter(config)
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert shapes["midlayer.self_attn.q_proj.weight"] == (8192, 14336) and shapes["fc.weight"] == (7168, 21504)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (7168, 8192)


def test_flop_formula_matches_torchs_count_at_small_widths():
    from torch.utils.flop_counter import FlopCounterMode

    config = drafter_config_from_target(kimi_text_config(reduced=True), [2, 30, 58], 256)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    rows, tokens, steps = 2, 24, 3
    aux, ids = torch.randn(rows, tokens, config.aux_width), torch.randint(0, config.vocab_size, (rows, tokens))
    with FlopCounterMode(display=False) as counter:
        sum(logits.sum() for logits in ttt_steps(drafter, aux, ids, steps, attention="scores")).backward()
    flops = training_flops(config, [tokens] * rows, steps)
    # torch does not count, on the CPU, step 0's fused attention nor the own keys' elementwise products
    unseen = 3 * (flops.attention_real / steps + flops.attention_own)
    assert counter.get_total_flops() == flops.training - unseen


def test_offline_batches_travel_in_storage_form_and_prefetched_ones_are_the_same(rehearsal):
    from eyas.train.data import OfflineSource, Prefetcher

    source = OfflineSource(rehearsal["stores"]["fp8"], "train", 96, torch.device("cpu"), torch.float32)
    assert len(source.batches) > 2
    host = source.host_batch(0)
    assert host["aux"].dtype == torch.float8_e4m3fn and host["aux_scale"].shape[-1] == 3  # widened only on the device
    batch, store = source.to_device(host), FeatureStore(rehearsal["stores"]["fp8"], "train", dtype=torch.float32)
    first = store[source.batches[0][0]]
    torch.testing.assert_close(batch.aux[0, : len(first["input_ids"])], first["aux"], rtol=0, atol=0)
    loader = Prefetcher(source)
    loader.ahead([2, 1])
    try:
        for index in (2, 1, 0):  # 0 was not asked ahead: loaded on the spot
            got, want = loader.batch(index), source.batch(index)
            assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("aux", "final", "input_ids", "loss_mask", "valid"))
    finally:
        loader.close()


def test_the_head_directory_is_a_target_spec_for_a_fresh_eyas_process(rehearsal):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "eyas", "inspect", rehearsal["spec"]], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "language_model.model.layers: N = 61" in done.stdout and "[2, 30, 58]" in done.stdout
