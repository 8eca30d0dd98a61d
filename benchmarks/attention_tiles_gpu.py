"""Split-cache attention's tile sizes against SDPA, in CUDA graphs: 648 slots, 9 query / 3 key heads, bf16.

    PYTHONPATH=src python benchmarks/attention_tiles_gpu.py

For 1, 33, 49 and 61 tokens: µs per call of the key/value heads repeated + SDPA, then of
eyas.engine.attention.attend with TILE_ROWS query rows per program and MERGE_ROWS per merging program
(the module's constants, set here for each run); "WRONG" marks an output off the fp32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton_kernels_gpu import graph_time

import eyas.engine.attention as kernels


def main() -> None:
    device, slots, heads, kv_heads, dim = torch.device("cuda"), 648, 9, 3, 64
    group = heads // kv_heads
    kernels.MAX_ROWS = 512
    for n in (1, 33, 49, 61):
        q = torch.randn(1, heads, n, dim, device=device, dtype=torch.bfloat16)
        keys = torch.randn(1, kv_heads, slots, dim, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        visible = torch.zeros(n, slots, dtype=torch.bool, device=device)
        visible[:, : slots - n - 5] = True
        visible[:, slots - n - 5 : slots - 5] = torch.eye(n, dtype=torch.bool, device=device) | (
            torch.rand(n, n, device=device) < 0.4).tril()
        mask = torch.zeros(n, slots, device=device, dtype=torch.bfloat16).masked_fill(~visible, torch.finfo(torch.bfloat16).min)
        mask = mask[None, None]
        expected = F.scaled_dot_product_attention(
            q.float(), keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float(),
            attn_mask=visible, scale=dim**-0.5).transpose(1, 2).reshape(1, n, -1)

        def repeated_sdpa(q=q, keys=keys, values=values, mask=mask):
            k = keys[:, :, None].expand(1, kv_heads, group, slots, dim).reshape(1, heads, slots, dim)
            v = values[:, :, None].expand(1, kv_heads, group, slots, dim).reshape(1, heads, slots, dim)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5)

        line = [f"n {n}: repeat+SDPA {graph_time(repeated_sdpa)[0]:.1f}"]
        for tile in (16, 32, 64, 128):
            for merge in (16, 32):
                kernels.TILE_ROWS, kernels.MERGE_ROWS = tile, merge
                seconds, out = graph_time(lambda q=q, keys=keys, values=values, mask=mask: kernels.attend(
                    q, keys, values, mask, dim**-0.5))
                wrong = (out.float() - expected).abs().max().item() > 3e-2
                line.append(f"tile {tile}/merge {merge} {seconds:.1f}{' WRONG' if wrong else ''}")
        print(", ".join(line), flush=True)


if __name__ == "__main__":
    main()
