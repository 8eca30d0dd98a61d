"""GPU check of eyas' Triton kernels: equal to torch, and their time against torch's, in CUDA graphs.

    PYTHONPATH=src python benchmarks/triton_kernels_gpu.py

Top-k (eyas.engine.topk.largest vs torch.topk) and split-cache attention (eyas.engine.attention.attend vs
the key/value heads repeated, then SDPA with the additive mask), each compiled by torch.compile and
recorded 20 times in one CUDA graph; µs per call. Ends with "KERNELS ALL OK" or how many failed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.engine.attention import additive_mask, attend
from eyas.engine.topk import largest


def recorded(fn, calls: int = 1):
    """(a CUDA graph of ``calls`` calls of ``fn``, warmed up on a side stream first, and its last output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_time(fn, iters: int = 200):
    """µs per call of ``fn`` replayed from a CUDA graph of 20 calls, and its last output."""
    graph, out = recorded(fn, 20)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3, out


def check_top_k(device) -> int:
    fails = 0
    for rows, n, k, dtype in [(8, 32000, 8, torch.bfloat16), (6, 32000, 8, torch.bfloat16), (1, 64, 8, torch.float32),
                              (10, 32000, 10, torch.bfloat16), (1, 49152, 1, torch.float32), (8, 32000, 8, torch.float32)]:
        x = torch.randn(rows, n, device=device).to(dtype)
        expected = x.float().topk(k, dim=-1).values
        ours, (values, indices) = graph_time(torch.compile(lambda x=x, k=k: largest(x, k), dynamic=False))
        theirs, _ = graph_time(torch.compile(lambda x=x, k=k: x.topk(k, dim=-1), dynamic=False))
        ok = torch.equal(values.float(), expected) and torch.equal(x.gather(1, indices).float(), expected)
        fails += not ok
        print(f"top-k rows {rows} n {n} k {k} {str(dtype)[6:]}: {'ok' if ok else 'WRONG'}; compiled+graph {ours:.1f} µs "
              f"vs torch.topk {theirs:.1f} µs", flush=True)
    return fails


def attention_case(device, heads: int, kv_heads: int, n: int, slots: int, dim: int = 64):
    """Random bf16 queries and cache, a committed prefix then a tree block then 5 unused slots → (q, keys,
    values, additive mask, the fp32 reference output [1, n, heads·dim], the repeated-heads SDPA step)."""
    group = heads // kv_heads
    q = torch.randn(1, heads, n, dim, device=device, dtype=torch.bfloat16)
    keys = torch.randn(1, kv_heads, slots, dim, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    length = slots - n - 5
    visible = torch.zeros(n, slots, dtype=torch.bool, device=device)
    visible[:, :length] = True
    visible[:, length : length + n] = (torch.rand(n, n, device=device) < 0.4).tril() | torch.eye(
        n, dtype=torch.bool, device=device)
    mask = additive_mask(visible, torch.bfloat16)
    expected = F.scaled_dot_product_attention(
        q.float(), keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float(),
        attn_mask=visible, scale=dim**-0.5).transpose(1, 2).reshape(1, n, -1)

    def repeated_sdpa():
        k = keys[:, :, None].expand(1, kv_heads, group, slots, dim).reshape(1, heads, slots, dim)
        v = values[:, :, None].expand(1, kv_heads, group, slots, dim).reshape(1, heads, slots, dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5)
        return out.transpose(1, 2).reshape(1, n, -1)

    return q, keys, values, mask, expected, repeated_sdpa


def check_attention(device, dim: int = 64) -> int:
    fails = 0
    for heads, kv_heads, n, slots in [(9, 3, 1, 660), (9, 3, 33, 660), (9, 3, 61, 660), (9, 3, 6, 660), (9, 9, 8, 676),
                                      (9, 3, 33, 2048), (9, 3, 1, 182)]:
        q, keys, values, mask, expected, repeated_sdpa = attention_case(device, heads, kv_heads, n, slots, dim)

        def split(q=q, keys=keys, values=values, mask=mask):
            return attend(q, keys, values, mask, dim**-0.5)

        theirs, reference = graph_time(torch.compile(repeated_sdpa, dynamic=False))
        if split() is None:
            print(f"attention heads {heads}/{kv_heads} n {n} slots {slots}: SDPA (past the kernels' rows); {theirs:.1f} µs")
            continue
        ours, out = graph_time(torch.compile(split, dynamic=False))
        error, sdpa_error = (out.float() - expected).abs().max().item(), (reference.float() - expected).abs().max().item()
        ok = error < 3e-2
        fails += not ok
        print(f"attention heads {heads}/{kv_heads} n {n} slots {slots}: error {error:.1e} (SDPA in bf16 {sdpa_error:.1e}) "
              f"{'ok' if ok else 'WRONG'}; compiled+graph {ours:.1f} µs vs repeat+SDPA {theirs:.1f} µs", flush=True)
    return fails


if __name__ == "__main__":
    device = torch.device("cuda")
    failed = check_top_k(device) + check_attention(device)
    print("KERNELS", "ALL OK" if not failed else f"{failed} FAILED")
