"""Split-cache attention's tile sizes against SDPA, in CUDA graphs: 648 slots, 9 query / 3 key heads, bf16.

    PYTHONPATH=src python benchmarks/attention_tiles_gpu.py

For 1, 33, 49 and 61 tokens: µs per call of the key/value heads repeated + SDPA, then of
eyas.engine.attention.attend with TILE_ROWS query rows per program and MERGE_ROWS per merging program
(the module's constants, set here for each run); "WRONG" marks an output off the fp32 reference.
"""

from __future__ import annotations

import torch
from triton_kernels_gpu import attention_case, graph_time

import eyas.engine.attention as kernels


def main() -> None:
    device, slots, heads, kv_heads, dim = torch.device("cuda"), 648, 9, 3, 64
    kernels.MAX_ROWS = 512
    for n in (1, 33, 49, 61):
        q, keys, values, mask, expected, repeated_sdpa = attention_case(device, heads, kv_heads, n, slots, dim)
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
