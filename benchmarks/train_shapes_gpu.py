"""Training tokens/s of variants of the trainer's step, the same data, one process per variant (each starts with empty
per-shape caches: cuDNN's attention graphs, compiled kernels), in one call. A variant is a batch-width multiple
(eyas.train.data.batch_width: widths rounded up to it; 1 = unrounded) and a TTT attention (eyas.families.eagle3.ttt.ATTENTION:
"concat", the GPU default, or "split").

    python benchmarks/train_shapes_gpu.py --target ~/stage/smollm2.gguf --data DATA_DIR [--steps 100]
        [--token-budget 16384] [--ttt-steps 7] [--multiples 64,1] [--attentions concat,split] [--out results.json]

Each variant builds what ``eyas train --online`` builds (``setup_training``: the target, the drafter, the teacher),
plans its batches with its own multiple, warms up on a few batches from the end of the first epoch's order, then
times ``--steps`` optimizer steps over the first batches of that order (``micro_batch`` + clip + AdamW, the trainer's
step), synchronised at both ends: a first epoch, where nearly every unrounded batch has a shape not seen before.
Prints tokens/s (real tokens, padding not counted) per variant, its peak memory, and each variant's ratio to the
first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def run_variant(args: argparse.Namespace) -> dict:
    import eyas.families.eagle3.ttt as ttt
    import eyas.train.data as data
    from eyas.train.data import epoch_order
    from eyas.train.options import TrainOptions
    from eyas.families.eagle3.objective import micro_batch
    from eyas.train.trainer import setup_training, training_autocast

    data.SHAPE_MULTIPLE = args.multiple  # width_multiple reads it when the sources are built (on CUDA)
    ttt.CUDA_ATTENTION = args.attention  # ttt_steps reads it at each call (on CUDA)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = TrainOptions(target=args.target, out=Path("/tmp/eyas-train-shapes"), data=args.data, online=True,
                           token_budget=args.token_budget, ttt_steps=args.ttt_steps)
    setup = setup_training(options, device)
    drafter, source, head, draft_ids = setup.drafter, setup.source, setup.head, setup.draft_ids
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=options.lr, betas=options.betas)
    weights = [options.step_decay**k for k in range(options.ttt_steps)]
    autocast = training_autocast(device)
    order = epoch_order(len(source.batches), options.seed, 0)
    if len(order) < args.steps + args.warmup:
        raise SystemExit(f"{args.data}: {len(order)} batches, fewer than --steps {args.steps} + --warmup {args.warmup}")

    def step(index: int) -> int:
        tallies = tuple(torch.zeros(options.ttt_steps, device=device) for _ in range(3))
        tokens = micro_batch(drafter, source.batch(index), head, draft_ids, options, weights, autocast, tallies)
        torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), options.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    for index in order[-args.warmup:]:  # the loss's compile, cuBLAS and the allocator warm up on other batches
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started, tokens = time.perf_counter(), 0
    for index in order[: args.steps]:
        tokens += step(index)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    shapes = len({(len(source.batches[i]), data.batch_width(max(len(source.samples[j].input_ids)
                                                                      for j in source.batches[i]), source.multiple))
                  for i in order[: args.steps]})
    result = {"multiple": args.multiple, "attention": args.attention, "steps": args.steps, "tokens": tokens, "seconds": seconds,
              "tokens_per_s": tokens / seconds, "distinct_shapes": shapes, "device": str(device),
              "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", type=Path, required=True, help="DATA_DIR (eyas prepare)")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, on other batches")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--multiples", default="64,1", help="the variants: batch widths rounded to these")
    parser.add_argument("--attentions", default="concat", help="and these TTT attentions (eyas.families.eagle3.ttt.ATTENTION)")
    parser.add_argument("--multiple", type=int, help=argparse.SUPPRESS)  # one variant, in a process of its own
    parser.add_argument("--attention", default="concat", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.multiple is not None:
        print(json.dumps(run_variant(args)))
        return
    rows = []
    variants = [(int(m), a) for m in args.multiples.split(",") for a in args.attentions.split(",")]
    for multiple, attention in variants:
        command = [sys.executable, __file__, "--target", args.target, "--data", str(args.data), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--token-budget", str(args.token_budget), "--ttt-steps",
                   str(args.ttt_steps), "--multiple", str(multiple), "--attention", attention]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:  # reported and recorded; the other variants still run
            print(f"variant {multiple}:{attention} failed:\n{done.stderr[-3000:]}", flush=True)
            rows.append({"multiple": multiple, "attention": attention, "error": done.stderr[-3000:]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        peak = f", peak {r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] else ""
        print(f"multiple {multiple:>3}, {attention:<6}: {r['tokens_per_s']:>10,.0f} tokens/s ({r['tokens']:,} tokens in "
              f"{r['seconds']:.1f} s, {r['distinct_shapes']} shapes in {r['steps']} batches{peak})", flush=True)
    measured = [r for r in rows if "error" not in r]
    for r in measured[1:]:
        print(f"{measured[0]['multiple']}:{measured[0]['attention']} vs {r['multiple']}:{r['attention']}: "
              f"{measured[0]['tokens_per_s'] / r['tokens_per_s']:.2f}×")
    if measured:
        best = max(measured, key=lambda r: r["tokens_per_s"])
        print(f"fastest: multiple {best['multiple']}, attention {best['attention']}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
