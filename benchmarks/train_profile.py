"""Where a training step's time goes: the target's capture, the teacher, each TTT step, backward, AdamW.

    python benchmarks/train_profile.py --target demo --data DATA_DIR [--ttt-steps 7] [--token-budget 16384]
        [--batches 4] [--largest] [--kernels 20]

The same objects ``eyas train --online`` builds (``eyas.train.trainer.setup_training``) run a few of
its batches; every phase is timed with the device synchronised on both sides, so the phases add up
to the step (the trainer itself overlaps a little more). ``--largest`` takes the batches with the
longest sequences (attention grows with length²), otherwise the first ones of the plan. Then one
batch runs under torch.profiler and the operators that took the most device time (CPU time off CUDA)
are listed. Prints tokens/s of the whole step, to compare with the trainer's own figure.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from eyas.families.eagle3.loss import step_loss, target_signal
from eyas.families.eagle3.ttt import ttt_steps
from eyas.train.options import TrainOptions
from eyas.train.trainer import setup_training, training_autocast


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(setup: dict, optimizer, index: int, options: TrainOptions, device, autocast, times: dict) -> int:
    """One micro-batch, optimizer step included; adds each phase's seconds to ``times``; returns its tokens."""

    def phase(name, fn):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times[name] += time.perf_counter() - start
        return out

    drafter = setup.drafter
    batch = phase("capture (target forward)", lambda: setup.source.batch(index))
    signal = phase("teacher (target lm_head)", lambda: target_signal(batch.final, setup.head, setup.draft_ids))
    total = 0.0
    with autocast():
        unrolled = ttt_steps(drafter, batch.aux, batch.input_ids, options.ttt_steps)
        for k in range(options.ttt_steps):
            result = phase(f"TTT step {k} forward + loss", lambda k=k: step_loss(next(unrolled), signal, batch.loss_mask, k))
            total = total + options.step_decay**k * result.loss
    phase("backward", lambda: total.backward())

    def update():
        torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), options.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    phase("clip + AdamW", update)
    return batch.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--data", type=Path, required=True, help="DATA_DIR (eyas prepare)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--batches", type=int, default=4, help="timed batches (after one warm-up batch)")
    parser.add_argument("--largest", action="store_true", help="the batches of the longest sequences")
    parser.add_argument("--kernels", type=int, default=20, help="operators listed from the profiled batch (0: none)")
    args = parser.parse_args()

    options = TrainOptions(target=args.target, data=args.data, online=True, ttt_steps=args.ttt_steps,
                           token_budget=args.token_budget, out=Path("unused"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = setup_training(options, device)
    source, drafter = setup.source, setup.drafter
    drafter.train()
    autocast = training_autocast(device)
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=options.lr, betas=options.betas,
                                  weight_decay=options.weight_decay)  # as the trainer builds it

    def longest(i: int) -> int:
        return max(len(source.samples[j].input_ids) for j in source.batches[i])

    order = sorted(range(len(source.batches)), key=longest, reverse=True) if args.largest else list(range(len(source.batches)))
    chosen = order[: args.batches + 1]
    shapes = [(len(source.batches[i]), longest(i)) for i in chosen]
    print(f"{device}, TTT {args.ttt_steps}, batches (sequences × longest): {shapes}")

    one_step(setup, optimizer, chosen[0], options, device, autocast, defaultdict(float))  # warm-up
    times: dict = defaultdict(float)
    tokens = sum(one_step(setup, optimizer, i, options, device, autocast, times) for i in chosen[1:])
    wall = sum(times.values())
    for name, seconds in times.items():
        print(f"{name:<32} {seconds / max(1, len(chosen) - 1) * 1e3:9.1f} ms/batch  {seconds / wall:6.1%}")
    print(f"{'whole step':<32} {wall / max(1, len(chosen) - 1) * 1e3:9.1f} ms/batch  {tokens / wall:,.0f} tokens/s")

    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            one_step(setup, optimizer, chosen[-1], options, device, autocast, defaultdict(float))
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.kernels))


if __name__ == "__main__":
    main()
