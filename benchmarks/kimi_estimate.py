"""What issue 23's groups (benchmarks/kimi_scale.py) should find, computed on the CPU before any GPU run.

    PYTHONPATH=src python3 benchmarks/kimi_estimate.py [--out DIR] [--ttt-steps 7]

Memory per stage (the rehearsal target's weights, a capture batch, the drafter's weights/gradients/AdamW, the TTT
unroll and its loss kept for backward, measured on meta tensors by eyas.families.eagle3.memory), rates expected at 40 % MFU
from eyas.families.eagle3.flops, the disk plan per storage dtype, and how long this host takes to widen one fp8 batch to
float32 (what the GPU waited for before offline batches travelled in storage form). Writes run.json, estimate.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from kimi_scale import DRAFT_VOCAB, LAYER_IDS, disk_plan

from run_record import run_folder, write_run_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="run folder (default benchmarks/results/<date>_cpu_kimi-estimate)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    args = parser.parse_args()
    out = args.out or run_folder("kimi-estimate", "CPU")
    write_run_json(out, "CPU", notes="issue 23: estimates before any GPU run (arithmetic and meta tensors)")
    result = estimate(args)
    (out / "estimate.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def estimate(args) -> dict:
    """Memory per stage and rates expected from FLOPs, computed on the CPU."""
    from eyas.families.eagle3.config import drafter_config_from_target
    from eyas.families.eagle3.flops import H200_BF16_DENSE, training_flops
    from eyas.families.eagle3.memory import ttt_saved_bytes
    from eyas.store import fp8
    from eyas.store.shards import bytes_per_token
    from eyas.target.rehearsal import RehearsalConfig, RehearsalForConditionalGeneration, kimi_text_config

    text = kimi_text_config()
    with torch.device("meta"):
        target = RehearsalForConditionalGeneration(RehearsalConfig(text_config=text))
    target_params = sum(p.numel() for p in target.parameters())
    per_layer_active = 101.0e6 + 9 * 3 * 7168 * 2048  # MLA + 8 routed + 1 shared experts (layer 0: dense, the same)
    prefill_flops = 2 * 61 * per_layer_active  # per token, logits_to_keep=1 (attention scores ~1 % more at T ≈ 1.7 k)
    config = drafter_config_from_target(text, LAYER_IDS, DRAFT_VOCAB)
    from eyas.families.eagle3.model import Eagle3Drafter

    with torch.device("meta"):
        drafter = Eagle3Drafter(config)
    total = sum(p.numel() for p in drafter.parameters())
    trainable = sum(p.numel() for p in drafter.trainable_parameters())
    states = 4 * total + 12 * trainable + 2 * trainable  # fp32 weights; grads + AdamW moments; autocast's bf16 copies
    budget, length = 8192, 2048
    rows = budget // length
    lengths = [length] * rows
    flops = training_flops(config, lengths, args.ttt_steps)
    saved = ttt_saved_bytes(config, rows, length, args.ttt_steps)
    batch_in = budget * (4 * 3 * 7168 + 4 * 7168) + budget * DRAFT_VOCAB * 4  # fp32 aux + final, teacher probs
    capture_batch = 16384 * 7168 * 2 * (3 + 1 + 1) + 16384 * 64 * (192 * 3 + 128) * 2 * 2  # aux/final/residual; q,k,v,out
    # what the GPU would have waited for before the loader fix: widening one fp8 batch to fp32 on this host
    q = torch.randn(budget, 4 * 7168).to(torch.float8_e4m3fn)
    scale = torch.ones(budget, 4)
    start = time.perf_counter()
    fp8.dequantize(q, scale, torch.float32)
    host_decode = time.perf_counter() - start
    at = 0.4 * H200_BF16_DENSE
    step_seconds = (flops.training + flops.teacher) / at
    return {
        "target": {"parameters": target_params, "bf16_GB": target_params * 2 / 1e9, "routed_experts": 8,
                   "prefill_GFLOP_per_token": prefill_flops / 1e9,
                   "prefill_tokens_per_s_at_40pct_MFU": at / prefill_flops,
                   "capture_batch_transient_GB_16k_tokens": capture_batch / 1e9},
        "store": disk_plan({d: bytes_per_token(7168, 3, d) for d in ("bf16", "fp8")}),
        "drafter": {"parameters": total, "trainable": trainable, "weights_grads_adam_GB": states / 1e9,
                    "teacher_lm_head_bf16_GB": 163840 * 7168 * 2 / 1e9},
        "micro_batch": {"tokens": budget, "rows": rows, "length": length, "ttt_steps": args.ttt_steps,
                        "saved_for_backward_GB": saved / 1e9, "inputs_GB": batch_in / 1e9,
                        "training_GFLOP_per_token": flops.training / budget / 1e9,
                        "teacher_GFLOP_per_token": flops.teacher / budget / 1e9,
                        "expected_step_s_at_40pct": step_seconds, "expected_tokens_per_s_at_40pct": budget / step_seconds,
                        "offline_peak_GB_estimate": (states + saved + batch_in) / 1e9 + 2.35,
                        "online_peak_GB_estimate": (states + saved + batch_in + capture_batch / 2) / 1e9 + 65.4,
                        "host_fp8_to_fp32_decode_s_this_cpu": host_decode},
    }


if __name__ == "__main__":
    main()
