"""What the HF capture costs the GPU per token, eager and with its decoder layers compiled (``--compile-layers``).

Issue 48: a producer on the trainer's GPU adds its capture's GPU time to every training step. This times the capture
a stream runs — :func:`eyas.capture.batch.capture_batch` over DATA_DIR's training batches as a stream plans them
(the token budget, length-sorted) — both ways in one process on the same batches:
- GPU time per real token: the kernels' own time from torch.profiler (what the capture takes from a shared GPU);
- wall time per real token (synchronised; launches included);
- how far the compiled capture's states are from the eager one's (max |Δ|, and the share of elements bit-equal).

Run on the GPU machine, eyas importable (PYTHONPATH=src):
    python3 benchmarks/capture_cost_gpu.py --target ~/stage/smollm2.gguf --data DATA_DIR [--token-budget 32768]
Prints a table; writes capture_cost.json under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from eyas.capture.batch import capture_batch
from eyas.target import load_target
from eyas.target.layer_ids import resolve_layer_ids
from eyas.train.data import planned_split, width_multiple


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--warmup", type=int, default=6, help="batches run first (compilation, cuBLAS)")
    parser.add_argument("--batches", type=int, default=30, help="batches timed")
    parser.add_argument("--profiled", type=int, default=6, help="batches under the profiler (GPU time)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda:0", help="cpu: a dry run of the script (a CPU capture is eager)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    target = load_target(args.target, device=args.device)
    layer_ids = resolve_layer_ids(None, target.layout.num_layers)
    samples, batches = planned_split(args.data, "train", args.token_budget, width_multiple(args.device))
    rows = [[samples[i] for i in batch] for batch in batches[: args.warmup + args.batches]]

    def capture(batch_rows, compile_layers):
        pack = capture_batch(target, batch_rows, layer_ids, "bf16", compile_layers)
        if pack.ready is not None:
            pack.ready.synchronize()
        return pack

    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "data": str(args.data),
                     "token_budget": args.token_budget, "batches_timed": args.batches}
    for name, compile_layers in (("eager", False), ("compiled", True)):
        began = time.perf_counter()
        for batch_rows in rows[: args.warmup]:
            capture(batch_rows, compile_layers)
        warmup_s = time.perf_counter() - began
        timed = rows[args.warmup:]
        tokens = sum(len(r.input_ids) for batch_rows in timed for r in batch_rows)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        for batch_rows in timed:
            capture(batch_rows, compile_layers)
        wall = time.perf_counter() - began
        profiled = timed[: args.profiled]
        with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            for batch_rows in profiled:
                capture(batch_rows, compile_layers)
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.self_device_time_total for e in events)
        kernels = sum(e.count for e in events)
        profiled_tokens = sum(len(r.input_ids) for batch_rows in profiled for r in batch_rows)
        results[name] = {"warmup_s": warmup_s, "tokens": tokens, "wall_us_per_token": wall / tokens * 1e6,
                         "tokens_per_s": tokens / wall, "gpu_us_per_token": gpu_us / profiled_tokens,
                         "kernels_per_batch": kernels / len(profiled),
                         "top_kernels": [(e.key[:80], round(e.self_device_time_total / profiled_tokens * 1e3, 2))
                                         for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]]}
    worst, equal, total, relative = 0.0, 0, 0, {}
    for batch_rows in rows[args.warmup: args.warmup + 4]:
        eager, fused = capture(batch_rows, False), capture(batch_rows, True)
        for key in ("aux", "final"):
            a, b = eager.tensors[key].float(), fused.tensors[key].float()
            worst = max(worst, (a - b).abs().max().item())
            equal, total = equal + int((a == b).sum()), total + a.numel()
            # per token: ‖Δ‖ / ‖eager‖ over its states (each tap's H columns for aux), the worst token's
            parts = a.view(len(a), -1, target.layout.hidden_size), b.view(len(b), -1, target.layout.hidden_size)
            per_token = (parts[0] - parts[1]).norm(dim=-1) / parts[0].norm(dim=-1).clamp_min(1e-12)
            relative[key] = max(relative.get(key, 0.0), per_token.max().item())
    results["compiled_vs_eager"] = {"max_abs_diff": worst, "bit_equal_share": equal / total,
                                    "worst_token_relative_error": relative}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| capture | GPU µs/token | wall µs/token | tokens/s | kernels/batch | warm-up s |\n|---|---|---|---|---|---|")
    for name in ("eager", "compiled"):
        r = results[name]
        print(f"| {name} | {r['gpu_us_per_token']:.3f} | {r['wall_us_per_token']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['kernels_per_batch']:.0f} | {r['warmup_s']:.1f} |")
    ratio = results["compiled"]["gpu_us_per_token"] / max(results["eager"]["gpu_us_per_token"], 1e-12)
    print(f"compiled / eager GPU time: {ratio:.3f}; "
          f"states: max |Δ| {worst:.3g}, bit-equal {equal / total:.4f}, worst token's ‖Δ‖/‖eager‖ "
          f"aux {relative['aux']:.3g}, final {relative['final']:.3g}")


if __name__ == "__main__":
    main()
