"""`eyas capture --engine vllm` through the real vLLM CPU build, against eyas' HF capture (fp32 compute).

Run with `make test-vllm` (it builds the vLLM venv, benchmarks/vllm_env.sh, and sets EYAS_VLLM_PYTHON); `make test`
leaves this file out (tests/conftest.py): each capture starts a vLLM engine, about two minutes on two cores.
Targets are tiny random models vLLM's CPU kernels take: head_dim 32 (its CPU attention rejects 16), and for
DeepSeek-V3 the real MLA dims (kv_lora 512, rope 64, nope 128, v 128: the CPU MLA backend's only shape), saved by
transformers as a user would (so the config lacks topk_method / scoring_func, which eyas supplies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from eyas.store.compare import compare_stores, describe_differences

LAYERS = 4
LAYER_IDS = (1, 2, 3)
WIDTH = 128
EXACT = 1e-4  # fp32 vs fp32: measured ≤ 2e-6; vLLM's corrupted MLA rotary is ~1e-2
ROTARY_ON = '{"custom_ops": ["+rotary_embedding"]}'  # keeps vLLM's CPU rotary op: the documented way to turn off the fix
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _vllm_python() -> str:
    python = os.environ.get("EYAS_VLLM_PYTHON")
    assert python, "set EYAS_VLLM_PYTHON to the vLLM venv's python (make test-vllm does)"
    return python


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=WIDTH, intermediate_size=256, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=zoo.VOCAB,
                                        max_position_embeddings=256, pad_token_id=0))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=WIDTH, intermediate_size=256, num_hidden_layers=LAYERS,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                              vocab_size=zoo.VOCAB, max_position_embeddings=256, pad_token_id=0))


def _deepseek_v3(rope: dict | None = None):
    from transformers import DeepseekV3ForCausalLM

    rope_args = {} if rope is None else {"rope_parameters": rope}
    return DeepseekV3ForCausalLM(zoo.deepseek_v3_config(
        hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, **rope_args))


TARGETS = {"llama": _llama, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3,
           "deepseek_v3_yarn": lambda: _deepseek_v3(YARN)}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-real")
    zoo.write_data_dir(root / "data", sizes=(("train", 4), ("holdout", 2)))
    return root


def _target(root: Path, name: str) -> str:
    directory = root / name
    if not directory.is_dir():
        torch.manual_seed(0)
        TARGETS[name]().float().eval().save_pretrained(directory)
    return str(directory)


def _eyas(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "eyas", *args], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    print(done.stderr[-3000:] if done.returncode else "", done.stdout[-2000:])
    return done


def _capture(root: Path, target: str, out: str, *extra: str, engine: str = "vllm", dtype: str = "fp32",
             env: dict | None = None) -> Path:
    features = root / out
    vllm = ("--vllm-python", _vllm_python()) if engine == "vllm" else ()
    done = _eyas("capture", "--target", target, "--data", str(root / "data"), "--out", str(features), "--dtype", dtype,
                 "--layer-ids", ",".join(map(str, LAYER_IDS)), "--engine", engine, *vllm, *extra, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return features


def _engine(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())["vllm_engine"]


def _check(store: Path, target: str) -> subprocess.CompletedProcess:
    return _eyas("capture", "--check", str(store), "--target", target)


@pytest.mark.parametrize("name", list(TARGETS))
def test_vllm_capture_equals_hf_capture(root, name):
    target = _target(root, name)
    reference = _capture(root, target, f"{name}-hf", engine="hf")
    store = _capture(root, target, f"{name}-vllm")
    worst = compare_stores(store, reference)
    print(f"{name}: vLLM vs HF, fp32: {describe_differences(worst)}")
    assert max(row["max_rel"] for row in worst.values()) < EXACT, worst
    assert _check(store, target).returncode == 0
    engine = _engine(store)
    assert engine["llm_args"]["dtype"] == "float32" and engine["llm_args"]["tensor_parallel_size"] == 1
    custom_ops = engine["llm_args"].get("compilation_config", {}).get("custom_ops")
    assert custom_ops == (["-rotary_embedding"] if name == "deepseek_v3" else None)  # MLA under default RoPE only
    if name.startswith("deepseek_v3"):
        assert engine["llm_args"]["hf_overrides"] == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_check_rejects_vllm_capture_with_the_cpu_rotary_op_on_mla(root, dtype):
    target = _target(root, "deepseek_v3")
    store = _capture(root, target, f"corrupt-{dtype}", "--compilation-config", ROTARY_ON, dtype=dtype)
    assert _engine(store)["llm_args"]["compilation_config"] == json.loads(ROTARY_ON)
    if dtype == "fp32":  # the corruption itself, measured without the check's error model
        worst = compare_stores(store, _capture(root, target, "deepseek_v3-hf", engine="hf"))
        print(f"deepseek_v3, vLLM's CPU rotary op on, vs HF: {describe_differences(worst)}")
        assert max(row["max_rel"] for row in worst.values()) > 1e-3, worst
    done = _check(store, target)
    assert done.returncode == 1, done.stdout[-2000:]


def test_tensor_parallel_2_stores_the_states_of_tensor_parallel_1(root):
    # MLA + MoE, the mission's architecture: the attention heads and the experts split over two CPU ranks, one core
    # each (vLLM's CPU build runs TP through its multiprocessing executor and gloo).
    target = _target(root, "deepseek_v3")
    single = _capture(root, target, "deepseek_v3-vllm")
    split = _capture(root, target, "deepseek_v3-vllm-tp2", "--tensor-parallel-size", "2",
                     env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert _engine(split)["llm_args"]["tensor_parallel_size"] == 2
    worst = compare_stores(split, single)
    print(f"deepseek_v3: vLLM TP 2 vs TP 1, fp32: {describe_differences(worst)}")
    assert max(row["max_rel"] for row in worst.values()) < EXACT, worst


def _eagle3_drafter(directory: Path) -> Path:
    """A random EAGLE-3 drafter for the Llama target, exported as eyas exports (vLLM's CPU attention: head_dim 32)."""
    from eyas.export.eagle3 import draft_config, draft_tensors
    from eyas.export.files import write_draft_dir
    from test_drafter_consistency import random_drafter, tiny_config
    from test_import_layouts import weights

    drafter = random_drafter(tiny_config(hidden_size=WIDTH, target_hidden_size=WIDTH, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, intermediate_size=256,
                                         vocab_size=zoo.VOCAB, draft_vocab_size=100, layer_ids=list(LAYER_IDS)))
    config = draft_config(drafter.config, "llama", LAYERS, "fp32")
    write_draft_dir(directory, config, draft_tensors(weights(drafter), config, "fp32"), "")
    return directory


def test_bench_in_real_vllm_agrees_with_eyas_and_quotes_a_refusal(root):
    """`eyas bench --engine eyas,vllm` through the real vLLM worker: both engines' greedy answers equal, plain and
    speculative, at every concurrency level's first; a drafter directory without weights is refused with the message
    the fake vLLM of tests/test_bench_engines.py quotes."""
    target = _target(root, "llama")
    draft = _eagle3_drafter(root / "draft-llama")
    out = root / "bench-vllm"
    done = _eyas("bench", "--target", target, "--draft", str(draft), "--out", str(out), "--engine", "eyas,vllm",
                 "--vllm-python", _vllm_python(), "--dataset", "sharegpt-holdout", "--data", str(root / "data"),
                 "--mode", "chain:2", "--concurrency", "1,2", "--max-new-tokens", "12", "--device", "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    engines = json.loads((out / "report.json").read_text())["engines"]
    assert {(r["mode"], r["concurrency"]) for r in engines["rows"]} == {("plain", 1), ("plain", 2), ("chain:2", 1),
                                                                        ("chain:2", 2)}
    for row in engines["comparison"]:
        assert row["equal_outputs"] == row["prompts"] > 0, row
        if row["mode"] == "chain:2":
            assert row["tau_engine"] == pytest.approx(row["tau_eyas"], rel=0.05), row
    empty = root / "draft-without-weights"
    empty.mkdir(exist_ok=True)
    (empty / "config.json").write_text((draft / "config.json").read_text())
    refused = _eyas("bench", "--target", target, "--draft", str(empty), "--out", str(root / "bench-refused"),
                    "--engine", "vllm", "--vllm-python", _vllm_python(), "--dataset", "sharegpt-holdout", "--data",
                    str(root / "data"), "--concurrency", "1", "--max-new-tokens", "4", "--device", "cpu")
    assert refused.returncode == 2 and f"vLLM refused the drafter {empty}" in refused.stderr
    assert "Cannot find any model weights" in refused.stderr
