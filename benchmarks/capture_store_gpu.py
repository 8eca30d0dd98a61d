"""`eyas capture` end to end on a GPU against plain prefill of the very same batches.

    PYTHONPATH=src python3 benchmarks/capture_store_gpu.py --target demo --data DATA_DIR --work /tmp/eyas-bench

Measures, in one run on one machine: tokens/s of plain prefill (no hooks, logits_to_keep=1) over
the capture plan's batches; tokens/s of capture alone (hooks + pinned copies, no store); and
tokens/s of the whole `eyas capture` stage (plan → capture → shards written, hashed and fsynced
on background threads), once per storage dtype. Prints a table and writes capture_store_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.data.samples import batch_inputs, read_samples
from eyas.store.plan import plan_shards
from eyas.target import capture_hidden_states, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/eyas-bench"))
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--shard-mb", type=int, default=64, help="smaller shards shorten the tail of writes after the last batch")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    samples = read_samples(args.data / "train.parquet")
    lengths = [len(s.input_ids) for s in samples]
    plan = plan_shards(lengths, args.token_budget, 64, 1 << 60)[0]
    batches = [_padded([samples[i] for i in batch]) for batch in plan.batches]
    tokens = sum(lengths)
    target = load_target(args.target)
    model, layout = target.model, target.layout

    def plain():
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids.cuda(non_blocking=True), attention_mask=mask.cuda(non_blocking=True), use_cache=False,
                      logits_to_keep=1)
        torch.cuda.synchronize()

    def capture_only():
        for ids, mask in batches:
            capture_hidden_states(model, layout, ids, attention_mask=mask)

    results = {"device": torch.cuda.get_device_name(), "samples": len(samples), "tokens": tokens, "batches": len(batches),
               "shard_mb": args.shard_mb}
    plain()  # warm-up: kernels, allocator
    capture_only()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return tokens / (time.perf_counter() - start)

    def stage(dtype: str) -> dict:
        out = args.work / f"features-{dtype}"
        shutil.rmtree(out, ignore_errors=True)
        report = capture(CaptureOptions(target=args.target, data=args.data, out=out, dtype=dtype, splits=("train",),
                                        token_budget=args.token_budget, shard_mb=args.shard_mb))
        shutil.rmtree(out, ignore_errors=True)
        return {"tokens_per_s": report.tokens_written / report.capture_seconds,
                "bytes_per_token": report.bytes_written / report.tokens_written,
                "gib_written": report.bytes_written / 2**30}

    # Interleaved: every measured run sits between two plain-prefill runs; its ratio uses their mean,
    # so drift of the machine (clocks, neighbours) cancels out.
    runs = [("capture_no_store", lambda: {"tokens_per_s": timed(capture_only)})]
    runs += [(f"eyas_capture_{d}", lambda d=d: stage(d)) for d in args.dtypes.split(",")]
    plain_rates = [timed(plain)]
    for name, fn in runs:
        results[name] = fn()
        plain_rates.append(timed(plain))
        results[name]["plain_tokens_per_s"] = (plain_rates[-2] + plain_rates[-1]) / 2
        results[name]["ratio"] = results[name]["tokens_per_s"] / results[name]["plain_tokens_per_s"]
    results["plain_prefill_tokens_per_s"] = plain_rates
    results["disk_write_gib_per_s"] = _disk_speed(args.work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture_store_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"\n| run ({tokens:,} tokens, {len(batches)} batches) | tokens/s | plain prefill around it | ratio | bytes/token |"
          "\n|---|---|---|---|---|")
    for name, _ in runs:
        row = results[name]
        print(f"| {name} | {row['tokens_per_s']:,.0f} | {row['plain_tokens_per_s']:,.0f} | {row['ratio']:.3f} | "
              f"{row.get('bytes_per_token', 0):,.0f} |")
    disk = results["disk_write_gib_per_s"] * 2**30
    print(f"disk: {results['disk_write_gib_per_s']:.2f} GiB/s with fsync → ceiling "
          + ", ".join(f"{d} {disk / results[f'eyas_capture_{d}']['bytes_per_token']:,.0f} tok/s" for d in args.dtypes.split(",")))


def _disk_speed(work: Path, gib: int = 2) -> float:
    """Sequential write speed of the store's disk with fsync, in GiB/s: the ceiling for any capture."""
    import os

    block = os.urandom(64 << 20)
    path = work / "disk-probe.bin"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(gib * 16):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return gib / seconds


def _padded(rows):
    ids, mask = batch_inputs(rows)
    return ids.pin_memory(), mask.pin_memory()


if __name__ == "__main__":
    main()
