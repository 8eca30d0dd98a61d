"""The soft cross-entropy of one TTT step, eager vs compiled chunk functions: values, gradients, time.

    python benchmarks/loss_kernels.py [--rows 8] [--tokens 2048] [--draft-vocab 32000] [--repeats 4]

Random bf16 logits [rows, tokens, draft vocab] against a teacher from a random lm_head (the demo
target's shapes by default); forward and backward of ``step_loss`` timed with the device
synchronised, the last of ``repeats`` runs reported. On CUDA (the compiled path is what training
uses there).
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas.families.eagle3.loss import step_loss, target_signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda")
    draft_ids = torch.randperm(args.vocab, device=device)[: args.draft_vocab].sort().values
    head = torch.randn(args.vocab, args.hidden, device=device, dtype=torch.bfloat16) * 0.05
    final = torch.randn(args.rows, args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    signal = target_signal(final, head, draft_ids)
    mask = torch.ones(args.rows, args.tokens, dtype=torch.uint8, device=device)
    base = (3 * torch.randn(args.rows, args.tokens, args.draft_vocab, device=device)).bfloat16()
    runs = {}
    for compile in (False, True):
        for _ in range(args.repeats):  # the first compiled run compiles
            logits = base.clone().requires_grad_()
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = step_loss(logits, signal, mask, 2, compile=compile)
            result.loss.backward()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        runs[compile] = (float(result.loss), logits.grad.float(), seconds)
        print(f"compile={compile}: loss {runs[compile][0]:.6f}, forward + backward {1000 * seconds:.1f} ms")
    difference = (runs[True][1] - runs[False][1]).abs().max().item()
    print(f"max |gradient difference| {difference:.3e} (largest gradient {runs[False][1].abs().max().item():.3e}); "
          f"loss difference {abs(runs[True][0] - runs[False][0]):.3e}")


if __name__ == "__main__":
    main()
