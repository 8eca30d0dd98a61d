"""Where a decoding round's time goes: its steps draft, verify, judge, commit; the prefill; the rest.

    python benchmarks/engine_profile.py --target demo --draft DRAFT_DIR [--variant eager|graphs|compile]
        [--modes plain,chain:5,tree:60,7,10] [--prompts 3] [--max-new-tokens 128] [--temperature 0]
        [--host-profile]

Each step is timed with the device synchronised on both sides, so the steps add up to the wall time (with
less host/device overlap than an untimed run has). With ``--variant eager`` every round runs its steps from
Python and each is timed; with CUDA graphs a round is one replay, timed as the bursts that replay it. MT-bench first turns, batch 1, greedy unless
``--temperature`` says otherwise. ``--host-profile``: the host functions that took the most time (cProfile
over each mode's timed prompts), for rounds that are host-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import defaultdict

import torch

import eyas.engine.decode as decode
from eyas.bench.run import timed
from eyas.data.benchmarks import mt_bench_questions, render
from eyas.engine.acceptance import Sampling
from eyas.engine.burst import Burst
from eyas.engine.loading import load_engine
from eyas.engine.modes import parse_mode
from eyas.engine import judges, proposers
from eyas.engine.round import Round
from eyas.engine.target_runner import TargetRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--variant", default="eager", choices=["eager", "graphs", "compile"])
    parser.add_argument("--modes", default="plain;chain:5;tree:60,7,10", help="';'-separated")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=2048, help="cache slots (static shapes attend over all of them)")
    parser.add_argument("--kernels", action="store_true", help="also list the GPU kernels of one eager plain step")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--host-profile", action="store_true", help="list the host functions that took longest")
    args = parser.parse_args()

    engine = load_engine(args.target, args.draft, args.capacity, graphs=args.variant != "eager",
                         compile=args.variant == "compile")
    device = engine.target_runner.device
    prompts = [torch.tensor([render(engine.target.tokenizer, text)]) for _, text in mt_bench_questions()[: args.prompts]]
    spent: dict[str, float] = defaultdict(float)

    def phase(name, fn):
        def wrapper(*a, **k):
            result, seconds = timed(device, lambda: fn(*a, **k))
            spent[name] += seconds
            return result
        return wrapper

    drafting = [(c, "propose", "draft") for c in vars(proposers).values() if isinstance(c, type) and hasattr(c, "propose")]
    judging = [(c, "judge", "judge") for c in vars(judges).values() if isinstance(c, type) and hasattr(c, "judge")]
    patches = [(TargetRunner, "prefill", "target prefill"), *drafting, (Round, "verify", "verify"), *judging,
               (Round, "commit", "commit"), (Burst, "extend", "bursts queued"), (Burst, "collect", "bursts read back")]
    for owner, attr, name in patches:
        setattr(owner, attr, phase(name, getattr(owner, attr)))
    for label in [m.strip() for m in args.modes.split(";") if m.strip()]:
        speculation = None if label == "plain" else parse_mode(label)
        def run(ids, speculation=speculation):
            return decode.generate(engine.target_runner, ids, args.max_new_tokens,
                                   engine.draft_runner if speculation else None, speculation,
                                   sampling=Sampling(temperature=args.temperature), stop_ids=engine.stop_ids)
        run(prompts[0])  # warm-up: graphs recorded
        spent.clear()
        tokens, rounds, total = 0, 0, 0.0
        host = cProfile.Profile() if args.host_profile else None
        for ids in prompts:
            if host is not None:
                host.enable()
            result, seconds = timed(device, lambda ids=ids: run(ids))
            if host is not None:
                host.disable()
            total += seconds
            tokens += len(result.tokens)
            rounds += result.rounds or len(result.tokens)
        print(f"{label}: {tokens / total:.1f} tok/s, {rounds} rounds, {1000 * total / rounds:.2f} ms per round")
        for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
            print(f"    {name:<16} {1000 * seconds / rounds:7.3f} ms/round")
        rest = total - sum(spent.values())
        print(f"    {'rest':<16} {1000 * rest / rounds:7.3f} ms/round")
        if host is not None:
            pstats.Stats(host).sort_stats("tottime").print_stats(12)
    if args.kernels and device.type == "cuda":
        kernels(engine, prompts[0])


@torch.no_grad()
def kernels(engine, prompt: torch.Tensor) -> None:
    """The GPU time of one plain decoding step, run eagerly under the profiler, by kernel."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.target_runner
    runner.prefill(prompt)
    length = torch.tensor([runner.length], device=runner.device)
    one = torch.ones(1, 1, dtype=torch.long, device=runner.device)
    step = lambda: runner.verify(length, one, length.view(1, 1), one)  # noqa: E731
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
