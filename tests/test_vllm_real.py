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
    from eyas.families.eagle3.export import draft_config, draft_tensors
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
                 "--mode", "chain:2", "--concurrency", "1,2", "--max-new-tokens", "12", "--device", "cpu", "--dtype", "fp32")
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



def test_long_prompts_are_benched_by_length_bucket_in_real_vllm_as_in_eyas(root):
    """`eyas bench --dataset sharegpt-long --engine eyas,vllm` on a target with a 4,096-token window: histories of
    250, 1,400 and 2,900 tokens, each engine's τ reported per length bucket, the greedy answers of the two engines
    equal, plain and speculative."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_bench import long_holdout

    target = root / "llama-4k"
    if not target.is_dir():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=WIDTH, intermediate_size=256, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=zoo.VOCAB,
                                     max_position_embeddings=4096, pad_token_id=0)).float().eval().save_pretrained(target)
    draft = _eagle3_drafter(root / "draft-llama")
    out = root / "bench-long"
    done = _eyas("bench", "--target", str(target), "--draft", str(draft), "--out", str(out), "--engine", "eyas,vllm",
                 "--vllm-python", _vllm_python(), "--dataset", "sharegpt-long", "--data", str(long_holdout(root / "long")),
                 "--mode", "chain:2", "--concurrency", "1", "--max-new-tokens", "8", "--temperature", "0",
                 "--device", "cpu", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    buckets = ["sharegpt-long:1k", "sharegpt-long:2k", "sharegpt-long:4k"]
    assert [r["dataset"] for r in report["rows"]] == buckets
    chain = next(r for r in report["engines"]["rows"] if r["mode"] == "chain:2")
    assert sorted(chain["tau_by_dataset"]) == buckets
    compared = report["engines"]["comparison"]
    assert {(r["mode"], r["dataset"]) for r in compared} == {(m, b) for m in ("plain", "chain:2") for b in buckets}
    for row in compared:  # one prompt a bucket
        assert row["equal_outputs"] == row["prompts"] == 1, row


def _trained_eagle31(target: str, data: Path, out: Path, steps: int = 1500) -> Path:
    """An EAGLE-3.1 drafter (fc_norm, norm_output) trained a few seconds by the training-time test on the target's own
    greedy answers to DATA_DIR's held-out prompts, the ones bench asks (so that drafts are accepted often enough for
    τ to mean something: this measures the engines' agreement, not the drafter), exported in fp32."""
    from eyas.data.benchmarks import holdout_prompts
    from transformers import AutoModelForCausalLM

    from eyas.export.files import write_draft_dir
    from eyas.families.eagle3.config import DrafterConfig
    from eyas.families.eagle3.export import draft_config, draft_tensors
    from eyas.families.eagle3.loss import step_loss, target_signal
    from eyas.families.eagle3.model import Eagle3Drafter
    from eyas.families.eagle3.ttt import ttt_steps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(target).float().eval()
    config = DrafterConfig(hidden_size=WIDTH, target_hidden_size=WIDTH, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=256, rms_norm_eps=1e-6, vocab_size=zoo.VOCAB,
                           draft_vocab_size=zoo.VOCAB, max_position_embeddings=256, layer_ids=list(LAYER_IDS),
                           fc_norm=True, norm_output=True)
    drafter = Eagle3Drafter(config)
    drafter.load_target_embedding(model.get_input_embeddings().weight)
    finals = []
    model.lm_head.register_forward_pre_hook(lambda module, args: finals.append(args[0].detach()))
    answers = []
    with torch.no_grad():
        for prompt in holdout_prompts(data):
            start = len(prompt.input_ids)
            seq = model.generate(torch.tensor([prompt.input_ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)[0]
            finals.clear()
            states = model(seq[None], output_hidden_states=True).hidden_states
            aux = torch.cat([states[i] for i in LAYER_IDS], -1)
            answers.append((seq[None], (torch.arange(len(seq)) >= start).to(torch.uint8)[None], aux, finals[-1]))
    head, everything = model.lm_head.weight.detach(), torch.arange(zoo.VOCAB)
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    for step in range(steps):
        ids, mask, aux, final = answers[step % len(answers)]
        signal = target_signal(final, head, everything)
        loss = sum(0.8**k * step_loss(logits, signal, mask, k, compile=False).loss
                   for k, logits in enumerate(ttt_steps(drafter, aux, ids, 3, attention="scores")))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tensors = {k: v.detach() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    exported = draft_config(config, "llama", LAYERS, "fp32")
    write_draft_dir(out, exported, draft_tensors(tensors, exported, "fp32"), "")
    return out


def test_an_eagle31_export_runs_in_real_vllm_as_in_eyas(root):
    """EAGLE-3.1's switches as vLLM reads them: an eyas-trained drafter with fc_norm and norm_output, benched by
    `eyas bench --engine eyas,vllm` (fp32, greedy, chain:3): the answers are the same, vLLM's τ (its spec-decode
    counters) equals eyas' τ, and the drafts are accepted often. With norm_output dropped from config.json (the same
    tensors) both engines run another network: its τ differs, and vLLM's still equals eyas' — vLLM honours the
    switch as eyas does."""
    target = _target(root, "llama")
    zoo.write_data_dir(root / "data-e31", sizes=(("train", 4), ("holdout", 8)))
    draft = _trained_eagle31(target, root / "data-e31", root / "draft-e31")
    plain = root / "draft-e31-no-norm-output"
    plain.mkdir(exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        (plain / name).write_bytes((draft / name).read_bytes())
    config = json.loads((draft / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "norm_output"}))
    taus = {}
    for directory in (draft, plain):
        out = root / f"bench-{directory.name}"
        done = _eyas("bench", "--target", target, "--draft", str(directory), "--out", str(out), "--engine", "eyas,vllm",
                     "--vllm-python", _vllm_python(), "--dataset", "sharegpt-holdout", "--data", str(root / "data-e31"),
                     "--mode", "chain:3", "--concurrency", "1", "--max-new-tokens", "32", "--temperature", "0",
                     "--device", "cpu", "--dtype", "fp32")
        assert done.returncode == 0, done.stderr[-3000:]
        rows = json.loads((out / "report.json").read_text())["engines"]["comparison"]
        (row,) = [r for r in rows if r["mode"] == "chain:3"]
        assert row["equal_outputs"] == row["prompts"] > 0, row
        print(f"{directory.name}: τ vLLM {row['tau_engine']:.4f}, eyas {row['tau_eyas']:.4f}")
        assert row["tau_engine"] == pytest.approx(row["tau_eyas"], abs=1e-9), row
        taus[directory.name] = row["tau_eyas"]
    assert taus[draft.name] > 1.5, taus
    assert taus[draft.name] != pytest.approx(taus[plain.name], abs=1e-3), taus

_DFLASH_WORKER = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    target, draft, k, prompts, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": k} if draft != "-" else None
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
              disable_log_stats=False, speculative_config=spec, seed=0, skip_tokenizer_init=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    counters = {m.name: m.value for m in llm.get_metrics() if m.name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": counters}, open(out, "w"))
"""


def _dflash_in_vllm(root: Path, target: str, draft: Path | None, k: int, prompts: list[list[int]]) -> dict:
    out = root / f"dflash-{draft.name if draft else 'plain'}.json"
    done = subprocess.run([_vllm_python(), "-c", _DFLASH_WORKER, target, str(draft or "-"), str(k), json.dumps(prompts),
                           str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _trained_dflash(root: Path, target: str, layers: int, layer_ids: list[int], same_k_norm: bool = False):
    """A DFlash drafter trained a few seconds on the target's own greedy answers (so that drafts are accepted often
    enough for τ to mean something), exported in fp32."""
    from transformers import AutoModelForCausalLM

    from eyas.families.dflash.config import DFlashConfig
    from eyas.families.dflash.export import write_dflash_dir
    from eyas.families.dflash.model import DFlashDrafter, dflash_loss, sample_anchors

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(target).float().eval()
    config = DFlashConfig(hidden_size=WIDTH, target_hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=zoo.VOCAB, block_size=4,
                          mask_token_id=zoo.VOCAB - 1, layer_ids=layer_ids, rope_theta=10000.0)
    drafter = DFlashDrafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.05)
    generator = torch.Generator().manual_seed(0)
    data = []
    with torch.no_grad():
        for _ in range(64):
            prompt = torch.randint(1, zoo.VOCAB - 6, (1, 8), generator=generator)
            seq = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0]
            states = model(seq[None], output_hidden_states=True).hidden_states
            data.append((seq, (torch.arange(len(seq)) >= 8).long(), torch.cat([states[i][0] for i in layer_ids], -1)))
    embed, head = model.get_input_embeddings().requires_grad_(False), model.lm_head.weight.detach()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(3000):
        seq, mask, features = data[step % len(data)]
        loss = dflash_loss(drafter, features, seq, mask, sample_anchors(mask, 4, 16, generator), embed, head, gamma=4.0)
        optimizer.zero_grad()
        loss.loss.backward()
        optimizer.step()
    drafter.eval()
    if same_k_norm:
        with torch.no_grad():
            for layer in drafter.layers[1:]:
                layer.self_attn.k_norm.weight.copy_(drafter.layers[0].self_attn.k_norm.weight)
    out = root / f"dflash-{layers}-{int(same_k_norm)}"
    write_dflash_dir(out, drafter, "fp32", 256)
    return model, drafter, out


def _reference_dflash(model, drafter, prompt: list[int], max_new: int, k: int) -> tuple[list[int], int, int]:
    """Greedy decoding with a DFlash drafter, written plainly: (answer, drafts accepted, verify rounds)."""
    from eyas.families.dflash.model import propose

    embed, head = model.get_input_embeddings(), model.lm_head.weight
    ids = drafter.config.layer_ids
    with torch.no_grad():
        seq = prompt + [int(model(torch.tensor([prompt])).logits[0, -1].argmax())]
        accepted = rounds = 0
        while len(seq) - len(prompt) < max_new:
            anchor = len(seq) - 1  # the last token: its target states are not known yet
            states = model(torch.tensor([seq[:anchor]]), output_hidden_states=True).hidden_states
            context = drafter.context(torch.cat([states[i] for i in ids], -1))
            drafts = propose(drafter, drafter.context_kv(context, torch.arange(anchor)[None]), seq[anchor], anchor, embed,
                             head)[:k].tolist()
            choice = model(torch.tensor([seq + drafts])).logits[0, anchor:].argmax(-1).tolist()
            n = 0
            while n < k and drafts[n] == choice[n]:
                n += 1
            seq += drafts[:n] + [choice[n]]
            accepted, rounds = accepted + n, rounds + 1
    return seq[len(prompt):][:max_new], accepted, rounds


@pytest.mark.parametrize("layers, layer_ids, same_k_norm", [(1, [1, 2, 3], False), (2, [1, 3], True)])
def test_dflash_export_runs_in_real_vllm_with_eyas_acceptance(root, layers, layer_ids, same_k_norm):
    """An eyas-exported DFlash drafter served by vLLM's `dflash` method: lossless, and exactly the drafts a plain
    reference loop over eyas' drafter accepts (same counts), so the layout, layer ids, mask and positions mean the
    same in both. Two layers are compared with equal k_norm weights: vLLM 0.32's CPU build normalises every layer's
    context keys with layer 0's k_norm (a grouped rms_norm without a per-layer weight stride; measured, LOG), so with
    different k_norms its acceptance differs from the model's."""
    target = _target(root, "llama")
    model, drafter, draft = _trained_dflash(root, target, layers, layer_ids, same_k_norm)
    prompts = [[5 + i, 17, 33 + i, 90, 12, 7 + i, 44, 61] for i in range(4)]
    ours = [_reference_dflash(model, drafter, p, 24, 3) for p in prompts]
    plain, spec = _dflash_in_vllm(root, target, None, 3, prompts), _dflash_in_vllm(root, target, draft, 3, prompts)
    assert spec["tokens"] == plain["tokens"] == [answer for answer, _, _ in ours]
    counters = spec["counters"]
    assert (counters["vllm:spec_decode_num_accepted_tokens"], counters["vllm:spec_decode_num_drafts"]) == (
        sum(a for _, a, _ in ours), sum(r for _, _, r in ours))
    assert sum(a for _, a, _ in ours) > 0  # drafts were accepted: the comparison has something to compare


_DSPARK_WORKER = """
import json, sys
if __name__ == "__main__":
    mode, target, draft, out = sys.argv[1:5]
    result = {}
    if mode == "serve":  # what vLLM's CPU build says when asked to serve the drafter
        from vllm import LLM
        try:
            LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
                speculative_config={"model": draft, "num_speculative_tokens": int(sys.argv[5])}, skip_tokenizer_init=True)
            result["refusal"] = None
        except Exception as err:
            result["refusal"] = str(err)
    else:  # vLLM's own config resolution and model class, fed the directory as its loader would be
        import torch
        import vllm.config.vllm as vllm_config_module
        vllm_config_module.HAS_TRITON = True  # Model Runner V2 is what the CPU lacks (Triton), not the model's code
        from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
        from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id
        from safetensors.torch import load_file
        target_config = ModelConfig(model=target, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
        spec = SpeculativeConfig(model=draft, num_speculative_tokens=int(sys.argv[5]), target_model_config=target_config,
                                 target_parallel_config=ParallelConfig())
        hf = spec.draft_model_config.hf_config
        result.update(method=spec.method, layer_ids=list(get_eagle3_aux_layers_from_config(spec)),
                      mask=get_parallel_drafting_token_id(hf), anchor_first=getattr(hf, "sample_from_anchor", True))
        config = VllmConfig(model_config=target_config, speculative_config=spec)
        context = set_current_vllm_config(config)
        context.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:29533")
        initialize_model_parallel(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=config, prefix="")
        weights = load_file(draft + "/model.safetensors")
        model.load_weights(weights.items())
        params = {name: p.data.clone() for name, p in model.named_parameters()}  # as loaded (the CPU repacks them)
        differ = []
        for name, tensor in weights.items():
            stem, _, kind = name.rpartition(".")
            layer, _, part = stem.rpartition(".")
            if part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # vLLM fuses q/k/v and gate/up
                fused = params["model." + layer + (".qkv_proj." if part[0] in "qkv" else ".gate_up_proj.") + kind]
                order = ["q_proj", "k_proj", "v_proj"] if part[0] in "qkv" else ["gate_proj", "up_proj"]
                start = sum(weights[layer + "." + o + "." + kind].shape[0] for o in order[: order.index(part)])
                mine = fused[start : start + tensor.shape[0]]
            else:
                mine = params.get("model." + name)
            if mine is None or not torch.equal(mine, tensor):
                differ.append(name)
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        ids = torch.tensor(json.loads(sys.argv[6]))
        hidden = torch.tensor(json.loads(sys.argv[7]))
        with torch.no_grad():
            embeds = model.markov_embed(ids)
            result.update(differ=differ, bias=model.markov_bias(embeds).tolist(),
                          confidence=model.compute_confidence(hidden, embeds).tolist())
    json.dump(result, open(out, "w"))
"""


def _dspark_in_vllm(root: Path, mode: str, target: str, draft: Path, block: int, ids: list[int],
                    hidden: list[list[float]]) -> dict:
    out = root / f"dspark-{mode}.json"
    done = subprocess.run([_vllm_python(), "-c", _DSPARK_WORKER, mode, target, str(draft), str(out), str(block),
                           json.dumps(ids), json.dumps(hidden)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_dspark_export_is_what_vllms_dspark_loader_reads_and_the_cpu_build_refuses_to_serve_it(root):
    """vLLM 0.32 serves DSpark on Model Runner V2 only, which needs Triton's GPU backend: its CPU build refuses the
    method (quoted below), so eyas' export is checked against vLLM's own code instead — its speculative config resolves
    the directory as dspark (no method given), with eyas' layer ids and mask token; its Qwen3DSparkForCausalLM loads
    every tensor (q/k/v and gate/up fused) unchanged; and its Markov bias and its confidence head's acceptance chance
    equal eyas' for the same tokens and slot states."""
    from eyas.families.dspark.config import DSparkConfig
    from eyas.families.dspark.export import write_dspark_dir
    from eyas.families.dspark.model import DSparkDrafter

    target = _target(root, "llama")
    config = DSparkConfig(hidden_size=WIDTH, target_hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=zoo.VOCAB, block_size=3,
                          mask_token_id=zoo.VOCAB - 1, layer_ids=[1, 3], rope_theta=10000.0, markov_rank=16,
                          confidence_head=True)
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.05)
    draft = write_dspark_dir(root / "dspark", drafter, "fp32", 256)
    ids = [3, 7, zoo.VOCAB - 1]
    hidden = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    refused = _dspark_in_vllm(root, "serve", target, draft, 3, ids, hidden.tolist())["refusal"]
    assert "Model Runner V1 does not support: dspark speculative decoding" in refused, refused
    read = _dspark_in_vllm(root, "load", target, draft, 3, ids, hidden.tolist())
    assert (read["method"], read["layer_ids"], read["mask"], read["anchor_first"]) == ("dspark", [1, 3], zoo.VOCAB - 1,
                                                                                       True)
    assert read["differ"] == []
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(read["bias"]), drafter.markov_head(torch.tensor(ids)))
        torch.testing.assert_close(torch.tensor(read["confidence"]),
                                   drafter.confidence(hidden, torch.tensor(ids)).sigmoid())


def test_streamed_training_from_vllm_equals_training_from_its_store(tmp_path):
    """eyas train --stream --stream-engine vllm: the vLLM worker asked for one training batch at a time, its files in
    shared memory; the weights are those of a run from a store vLLM captured of the same samples (a DATA_DIR listed in
    id order, captured with the training's token budget), and nothing but the run is written. The same from another
    host: --stream-listen and eyas produce --engine vllm (here over 127.0.0.1)."""
    import socket

    from safetensors.torch import load_file

    torch.manual_seed(0)
    target = tmp_path / "llama"
    _llama().float().eval().save_pretrained(target)
    data = Path(zoo.write_data_dir(tmp_path / "data", sizes=(("train", 12), ("holdout", 2)), id_digits=3))
    common = ["--target", str(target), "--max-steps", "4", "--token-budget", "256", "--checkpoint-every", "2",
              "--lr", "1e-3", "--ttt-steps", "2", "--eval-batches", "1", "--layer-ids", ",".join(map(str, LAYER_IDS))]
    store = tmp_path / "features"
    done = _eyas("capture", "--target", str(target), "--data", str(data), "--out", str(store), "--dtype", "bf16",
                 "--token-budget", "256", "--layer-ids", ",".join(map(str, LAYER_IDS)), "--engine", "vllm",
                 "--vllm-python", _vllm_python())
    assert done.returncode == 0, done.stderr[-2000:]
    common = [c for c in common if c not in ("--layer-ids", ",".join(map(str, LAYER_IDS)))]
    offline = _eyas("train", "--features", str(store), "--out", str(tmp_path / "offline"), *common)
    assert offline.returncode == 0, offline.stderr[-2000:]
    before = set(Path("/dev/shm").iterdir()) if Path("/dev/shm").is_dir() else set()
    streamed = _eyas("train", "--data", str(data), "--stream", "--stream-engine", "vllm", "--vllm-python",
                     _vllm_python(), "--out", str(tmp_path / "streamed"), "--layer-ids", ",".join(map(str, LAYER_IDS)),
                     *common)
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert "runs the target with vLLM" in streamed.stdout
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    producer = subprocess.Popen([sys.executable, "-m", "eyas", "produce", "--trainer", f"127.0.0.1:{port}", "--target",
                                 str(target), "--data", str(data), "--engine", "vllm", "--vllm-python", _vllm_python()],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    remote = _eyas("train", "--data", str(data), "--stream", "--stream-listen", f"127.0.0.1:{port}", "--out",
                   str(tmp_path / "remote"), "--layer-ids", ",".join(map(str, LAYER_IDS)), *common)
    said = producer.communicate(timeout=600)[0]
    assert remote.returncode == 0, remote.stderr[-2000:]
    assert producer.returncode == 0 and "the trainer stopped the stream" in said, said[-3000:]
    a, b, c = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("offline", "streamed", "remote"))
    for run, other in (("streamed", b), ("remote", c)):
        worst = max(float((a[name] - other[name]).abs().max()) for name in a)
        print(f"{run} from vLLM vs offline from vLLM's store: largest weight difference {worst:.3g}")
        assert worst == 0.0, run
    if before or Path("/dev/shm").is_dir():
        assert set(Path("/dev/shm").iterdir()) == before  # the worker's files are gone with it


@pytest.mark.parametrize("killed", ["producer", "trainer"])
def test_a_vllm_stream_killed_resumes_identical_and_leaves_no_worker(tmp_path, killed):
    """kill -9 of the producer (the trainer ends in one line after a checkpoint) or of the trainer (its producer, and
    the producer's vLLM worker, go with it): --resume ends with the uninterrupted run's weights."""
    import signal
    import time

    torch.manual_seed(0)
    target = tmp_path / "llama"
    _llama().float().eval().save_pretrained(target)
    data = Path(zoo.write_data_dir(tmp_path / "data", sizes=(("train", 12), ("holdout", 2)), id_digits=3))
    args = ["train", "--target", str(target), "--data", str(data), "--stream", "--stream-engine", "vllm",
            "--vllm-python", _vllm_python(), "--max-steps", "24", "--token-budget", "256", "--checkpoint-every", "2",
            "--lr", "1e-3", "--ttt-steps", "2", "--eval-batches", "1", "--layer-ids", ",".join(map(str, LAYER_IDS))]
    clean = _eyas(*args, "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-2000:]
    run = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "eyas", *args, "--out", str(run)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    producer = next(int(line.split("(pid ")[1].split(")")[0]) for line in process.stdout
                    if line.startswith("stream: the producer (pid "))
    end = time.monotonic() + 600
    while not (run / "checkpoints" / "step-00000004").is_dir():
        assert time.monotonic() < end and process.poll() is None, "no step-4 checkpoint"
        time.sleep(0.05)
    workers = _worker_pids()
    assert workers, "no vLLM worker running"
    os.kill(producer if killed == "producer" else process.pid, signal.SIGKILL)
    rest = process.stdout.read()
    code = process.wait()
    if killed == "producer":
        assert code == 2 and f"the stream's producer (pid {producer}) was killed by signal 9" in rest, rest[-3000:]
        errors = [line for line in rest.splitlines() if line.startswith("error:")]  # (vLLM's log has its own traces)
        assert len(errors) == 1 and "checkpointed at step" in errors[0], rest[-3000:]
        assert not list(Path("/dev/shm").glob(f"eyas-stream-{producer}-*"))  # the trainer removed what it left
    end = time.monotonic() + 120
    while set(_worker_pids()) & set(workers):  # its stdin closed, the worker ends (and its engine with it)
        assert time.monotonic() < end, "the vLLM worker outlived its producer"
        time.sleep(0.5)
    resumed = _eyas(*args, "--out", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    zoo.assert_same_final_weights(tmp_path / "clean", run)


def _worker_pids() -> list[int]:
    done = subprocess.run(["pgrep", "-f", "vllm_worker.py"], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]
