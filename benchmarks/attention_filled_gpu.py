"""Decode-time attention over a large cache, bounded by the filled length or not (issue 47, Build 3), on one GPU.

The engine records a decoding step once per cache, attention over every slot; `eyas.engine.attention.attend` takes the
filled length as a device tensor and reads no key or value past it. Here one step's attention (the demo target's
heads: 9 query heads over 3 key heads, head size 64, bf16) is recorded as a CUDA graph over a cache of CAPACITY slots
and replayed at several filled lengths, with and without the bound: microseconds per call, and the largest
difference from SDPA over the filled slots alone (keys past them are NaN: a read would show); exits 1 when a row differs
by more than TOLERANCE.

    python3 benchmarks/attention_filled_gpu.py [--capacity 8192] [--filled 512,1024,2048,4096,8192] [--tokens 1,6,61]
        [--out attention_filled.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM, SCALE = 9, 3, 64, 0.125
TOLERANCE = 0.05  # bf16 outputs against an fp32 reference; a read past the filled slots gives NaN


def reference(q, keys, values, filled: int, n: int) -> torch.Tensor:
    """SDPA over the first ``filled`` slots: the committed ones, then the step's n tokens causally."""
    visible = torch.ones(n, filled, dtype=torch.bool, device=q.device)
    visible[:, filled - n:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    group = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(q.float(), keys[:, :, :filled].repeat_interleave(group, 1).float(),
                                         values[:, :, :filled].repeat_interleave(group, 1).float(), attn_mask=visible,
                                         scale=SCALE)
    return out.transpose(1, 2).reshape(1, n, HEADS * DIM)


def measure(n: int, capacity: int, fills: list[int], bounded: bool, repeats: int) -> list[dict]:
    from eyas.engine.attention import attend
    from triton_kernels_gpu import recorded

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(n)
    q = torch.randn(1, HEADS, n, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    keys = torch.randn(1, KV_HEADS, capacity, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    values = torch.randn(1, KV_HEADS, capacity, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    mask = torch.zeros(1, 1, n, capacity, device=device, dtype=torch.bfloat16)
    filled = torch.tensor([capacity], device=device)
    step = (lambda: attend(q, keys, values, mask, SCALE, filled)) if bounded else (lambda: attend(q, keys, values, mask, SCALE))
    graph, out = recorded(step)  # one recording, replayed at every filled length
    rows = []
    for fill in fills:
        filled.fill_(fill)
        visible = torch.zeros(n, capacity, dtype=torch.bool, device=device)  # the engine's mask for this length
        visible[:, : fill - n] = True
        visible[:, fill - n: fill] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        mask.copy_(torch.zeros_like(mask).masked_fill(~visible, torch.finfo(torch.bfloat16).min))
        if bounded:  # past the filled slots the cache holds anything: a read would poison the output
            saved = keys[:, :, fill:].clone()
            keys[:, :, fill:] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        error = (out.float() - reference(q, keys, values, fill, n)).abs().max().item()
        if bounded:
            keys[:, :, fill:] = saved
        begin = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
        rows.append({"tokens": n, "capacity": capacity, "filled": fill, "bounded": bounded,
                     "us_per_call": (time.perf_counter() - begin) / repeats * 1e6, "max_error": error})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--filled", default="512,1024,2048,4096,8192", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--tokens", default="1,6,61", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from eyas.engine.attention import kernels_available

    if not torch.cuda.is_available() or not kernels_available(torch.device("cuda")):
        raise SystemExit("needs a CUDA GPU of compute capability 8.0 or newer with Triton")
    rows = [row for n in args.tokens for bounded in (False, True)
            for row in measure(n, args.capacity, args.filled, bounded, args.repeats)]
    print(f"{torch.cuda.get_device_name()}, cache {args.capacity} slots: µs per call (largest difference from SDPA)")
    print("| tokens | filled | whole cache | bounded | ratio |\n| --- | --- | --- | --- | --- |")
    for n in args.tokens:
        for fill in args.filled:
            whole, bound = (next(r for r in rows if r["tokens"] == n and r["filled"] == fill and r["bounded"] is b)
                            for b in (False, True))
            print(f"| {n} | {fill} | {whole['us_per_call']:.1f} | {bound['us_per_call']:.1f} ({bound['max_error']:.3f}) "
                  f"| {whole['us_per_call'] / bound['us_per_call']:.2f}× |")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    wrong = [row for row in rows if not row["max_error"] <= TOLERANCE]  # NaN fails too
    if wrong:
        raise SystemExit(f"{len(wrong)} rows differ from SDPA by more than {TOLERANCE}: {wrong}")


if __name__ == "__main__":
    main()
