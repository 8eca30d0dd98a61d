"""vLLM capture (extract_hidden_states) against eyas' HF capture, on the demo target.

Renders ~8 chat prompts with the target's chat template (two of them several hundred tokens),
captures them through vLLM with `capture_with_vllm` and in-process with `capture_hidden_states`
(CPU, fp32), and compares per layer id and for the final hidden: max abs diff, max relative diff
(max |a-b| / max |b| per sample), the 99.9th percentile of elementwise |a-b| / (|b| + eps), and
whether that is within bf16 tolerance (1e-2). It also checks what vLLM's ids mean: each state the
worker returned is matched against every HF state (eyas ids 0..N) and the closest is reported.

    .venv/bin/python benchmarks/capture_vllm_vs_hf.py --out /tmp/capture-vllm

Needs the vLLM virtualenv (benchmarks/vllm_env.sh setup) or EYAS_VLLM_PYTHON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from eyas.capture.vllm_client import capture_with_vllm, load_worker_states, worker_layer_ids
from eyas.target import capture_hidden_states, load_target

LAYER_IDS = (2, 15, 27)
BF16_RELATIVE = 1e-2  # bf16 keeps 8 mantissa bits: ~4e-3 per rounding, a few roundings deep
EPS = 1e-6


def conversations() -> list[list[dict]]:
    """Chat prompts of varied length; the two long ones quote real source code (stdlib modules)."""
    import json.decoder
    import textwrap

    short = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about autumn leaves."},
         {"role": "assistant", "content": "Crimson leaves drifting,\nwhispers on the cooling wind,\nthe old oak lets go."}],
        [{"role": "system", "content": "You are a terse assistant."},
         {"role": "user", "content": "Explain recursion in one sentence."}],
        [{"role": "user", "content": "List three prime numbers greater than 100."},
         {"role": "assistant", "content": "101, 103 and 107."},
         {"role": "user", "content": "And their sum?"}],
        [{"role": "user", "content": "Translate 'good morning, how did you sleep?' into German and Spanish."}],
        [{"role": "user", "content": "Give me a short recipe for pancakes, with quantities."}],
    ]
    long = [
        [{"role": "user", "content": "Review this code and summarise what it does:\n\n" + inspect.getsource(textwrap)[:3000]}],
        [{"role": "user", "content": "Find the bugs, if any:\n\n" + inspect.getsource(json.decoder)[:2400]},
         {"role": "assistant", "content": "I see no bug in the excerpt; it defines the JSON decoder's error type and constants."}],
    ]  # fmt: skip
    return short + long


def render(tokenizer) -> list[tuple[str, np.ndarray]]:
    """(id, input_ids) per conversation, rendered with the target's chat template."""
    samples = []
    for i, messages in enumerate(conversations()):
        open_turn = messages[-1]["role"] == "user"
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=open_turn)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        samples.append((f"chat-{i}", np.asarray(ids, dtype=np.int32)))
    return samples


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """Differences of ``a`` (vLLM) from ``b`` (HF), over samples."""
    abs_max = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    rel_max = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b, strict=True))
    elementwise = torch.cat([((x - y).abs() / (y.abs() + EPS)).flatten() for x, y in zip(a, b, strict=True)])
    p999 = float(np.quantile(elementwise.double().numpy(), 0.999))  # torch.quantile caps at 2**24 elements
    return {
        "max_abs_diff": abs_max,
        "max_rel_diff": rel_max,
        "p99_9_elementwise_rel": p999,
        "max_abs_ref": max(y.abs().max().item() for y in b),
        "within_bf16": rel_max <= BF16_RELATIVE and p999 <= BF16_RELATIVE,
    }


def best_matches(states_dir: Path, tapped: tuple[int, ...], hf_all: dict[str, torch.Tensor], hidden: int) -> list[dict]:
    """For each state the worker returned, the HF state (eyas id) closest to it (worst sample counts)."""
    index = [json.loads(line) for line in (states_dir / "index.jsonl").read_text().splitlines()]
    errors = torch.zeros(len(tapped), next(iter(hf_all.values())).shape[1] // hidden, dtype=torch.float64)
    for entry in index:
        states, _ = load_worker_states(states_dir, entry)
        every = hf_all[entry["id"]].view(states.shape[0], -1, hidden)  # [T, N+1, H]: eyas ids 0..N
        for slot in range(len(tapped)):
            # Per-token relative L2 error, averaged over tokens: a max-normalised error would be
            # dominated by the first token's massive activation, which barely changes across layers.
            per_token = (every - states[:, slot : slot + 1]).norm(dim=2) / every.norm(dim=2).clamp_min(EPS)
            errors[slot] = torch.maximum(errors[slot], per_token.mean(dim=0).double())
    rows = []
    for slot, vllm_id in enumerate(tapped):
        order = torch.argsort(errors[slot])
        rows.append({
            "vllm_id": vllm_id, "best_eyas_id": int(order[0]), "rel_diff": errors[slot, order[0]].item(),
            "runner_up_eyas_id": int(order[1]), "runner_up_rel_diff": errors[slot, order[1]].item(),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo")
    parser.add_argument("--out", type=Path, default=Path("/tmp/eyas-capture-vllm"))
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.out / "vllm_work"
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh capture, not a resume

    started = time.perf_counter()
    target = load_target(args.target, device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - started
    layout, n, width = target.layout, target.layout.num_layers, target.layout.hidden_size
    samples = render(target.tokenizer)
    lengths = [int(ids.size) for _, ids in samples]

    started = time.perf_counter()
    hf_all, hf_final = {}, {}
    for sample_id, ids in samples:
        states = capture_hidden_states(target.model, layout, torch.from_numpy(ids.astype(np.int64))[None], layer_ids=range(n + 1))
        hf_all[sample_id], hf_final[sample_id] = states.aux[0], states.final[0]
    hf_s = time.perf_counter() - started

    started = time.perf_counter()
    vllm = {sid: (aux, final) for sid, aux, final in capture_with_vllm(samples, args.target, LAYER_IDS, n, args.vllm_python, workdir)}
    vllm_s = time.perf_counter() - started

    ids = [sid for sid, _ in samples]
    results: dict = {"target": args.target, "layer_ids": list(LAYER_IDS), "num_layers": n, "samples": len(samples),
                     "tokens": lengths, "eps": EPS, "bf16_relative_tolerance": BF16_RELATIVE, "compare": {}}  # fmt: skip
    for k, layer in enumerate(LAYER_IDS):
        a = [vllm[s][0][:, k * width : (k + 1) * width] for s in ids]
        b = [hf_all[s].view(-1, n + 1, width)[:, layer] for s in ids]
        results["compare"][f"layer {layer}"] = compare(a, b)
    results["compare"]["final"] = compare([vllm[s][1] for s in ids], [hf_final[s] for s in ids])
    results["id_semantics"] = best_matches(workdir / "states", worker_layer_ids(LAYER_IDS, n), hf_all, width)
    results["timing_s"] = {"hf_load": round(load_s, 1), "hf_capture": round(hf_s, 1), "vllm_total_incl_engine_start": round(vllm_s, 1)}

    print(f"{len(samples)} samples, {sum(lengths)} tokens (lengths {lengths})")
    print(f"{'state':<10} {'max|a-b|':>10} {'max|b|':>10} {'max rel':>10} {'p99.9 rel':>10}  bf16-ok")
    for name, row in results["compare"].items():
        print(f"{name:<10} {row['max_abs_diff']:>10.3g} {row['max_abs_ref']:>10.3g} {row['max_rel_diff']:>10.3g} "
              f"{row['p99_9_elementwise_rel']:>10.3g}  {row['within_bf16']}")  # fmt: skip
    print("vLLM id → closest HF state (eyas id), mean per-token relative L2 error; runner-up")
    for row in results["id_semantics"]:
        print(f"  {row['vllm_id']:>3} → {row['best_eyas_id']:>3} ({row['rel_diff']:.2g}); "
              f"{row['runner_up_eyas_id']} ({row['runner_up_rel_diff']:.2g})")  # fmt: skip
    print("timing (s):", results["timing_s"])
    (args.out / "capture_vllm_vs_hf.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
