"""Issue 47's table: τ and tokens/s per prompt-length bucket, eyas' engine (plain and each mode) beside transformers'
static-cache generate at the same lengths, in one run.

    python benchmarks/long_context.py --target demo --draft DRAFT_DIR --data DATA_DIR [--prompts 5]
        [--max-new-tokens 256] [--modes chain:5,tree:60,7,10] [--no-compile] [--no-transformers] [--device cuda]
        [--dtype bf16|fp32] [--out DIR]

The prompts are eyas bench's ``sharegpt-long`` (each held-out conversation's history before its last answer, by
length bucket: 1k, 2k, 4k, 8k; a DATA_DIR prepared with ``--max-length`` up to the target's window reaches the long
ones), the first --prompts of each bucket. Each bucket is decoded over a cache of its own, as eyas bench decodes it
(eyas.bench.stage.measure_by_cache): by eyas' engine plain and in each mode (greedy: its warm-up, then every decoder
on each prompt; the default compiled decoder on a GPU unless --no-compile), then by transformers' generate over a
StaticCache of that capacity (eyas' hooks off the model by then; every prompt once untimed, then timed). The table:
bucket, prompts, mean prompt tokens, transformers static tok/s, eyas plain tok/s and its ratio to transformers, each
mode's τ, tok/s and ratio to eyas plain, greedy == plain. Written with run.json into --out (default
benchmarks/results/<date>_<machine>_long-context/).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from run_record import run_folder, write_run_json


def transformers_rate(model, prompts: list, capacity: int, max_new_tokens: int, stops: set[int]) -> float:
    """transformers' static-cache generate over ``prompts`` (one cache of ``capacity`` slots, reset between them):
    every prompt once untimed (its compilation), then tokens/s over all of them timed."""
    from transformers import StaticCache

    from eyas.bench.run import timed
    from engine_speed import hf_static

    device = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    rows = [torch.tensor([p.input_ids], device=device) for p in prompts]
    for ids in rows:
        hf_static(model, cache, ids, max_new_tokens, stops)
    tokens = seconds = 0.0
    for ids in rows:
        out, elapsed = timed(device, lambda ids=ids: hf_static(model, cache, ids, max_new_tokens, stops))
        tokens, seconds = tokens + len(out), seconds + elapsed
    return tokens / seconds if seconds else 0.0


def bucket_rows(args, target, prompts, modes) -> list[dict]:
    """One row per length bucket: eyas' engine over every bucket, each on a cache of its own (eyas bench's
    measure_by_cache), then transformers' static-cache generate at each bucket's capacity (the engine's hooks are off
    the model by then)."""
    from eyas.bench.options import BenchOptions
    from eyas.bench.stage import cache_groups, measure_by_cache
    from eyas.engine.room import checked_capacity
    from eyas.speculation import Sampling

    options = BenchOptions(target=args.target, out=Path("."), draft=args.draft, max_new_tokens=args.max_new_tokens,
                           device=args.device, compile=args.compile)
    result, stops = measure_by_cache(options, target, prompts, modes, [Sampling()], None)
    rows = []
    for group in cache_groups(prompts):
        bucket = group[0].dataset
        capacity = checked_capacity(target, max(len(p.input_ids) for p in group), args.max_new_tokens, modes,
                                    len(group))
        hf = None if args.no_transformers else transformers_rate(target.model, group, capacity, args.max_new_tokens,
                                                                  set(stops))
        plain, *speculative = result.datasets[bucket]
        rows.append({"bucket": bucket, "prompts": len(group), "capacity": capacity,
                     "mean_prompt_tokens": sum(len(p.input_ids) for p in group) / len(group),
                     "transformers_static_tokens_per_second": hf, "plain_tokens_per_second": plain.tokens_per_second,
                     "modes": [{"mode": r.mode, "tau": r.tau, "tokens_per_second": r.tokens_per_second,
                                "vs_plain": r.tokens_per_second / plain.tokens_per_second if plain.seconds else None,
                                "matches_plain": r.matches_plain} for r in speculative],
                     "decoder": result.settings.get("decoder")})
        print(table([rows[-1]]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as markdown: a line per bucket and mode."""
    lines = ["| bucket | prompts | mean prompt tokens | transformers static tok/s | eyas plain tok/s (× transformers) "
             "| mode | τ | tok/s (× eyas plain) | greedy == plain |", "|" + "---|" * 9]
    for row in rows:
        hf, plain = row["transformers_static_tokens_per_second"], row["plain_tokens_per_second"]
        versus = f" ({plain / hf:.2f}×)" if hf else ""
        for mode in row["modes"]:
            lines.append(f"| {row['bucket']} | {row['prompts']} | {row['mean_prompt_tokens']:,.0f} | "
                         f"{f'{hf:.1f}' if hf else '—'} | {plain:.1f}{versus} | {mode['mode']} | {mode['tau']:.2f} | "
                         f"{mode['tokens_per_second']:.1f} ({mode['vs_plain']:.2f}×) | "
                         f"{mode['matches_plain']}/{row['prompts']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="demo")
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="DATA_DIR: its holdout's histories")
    parser.add_argument("--prompts", type=int, default=5, help="prompts a bucket")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--modes", default="chain:5,tree:60,7,10")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' static-cache generate")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto", help="bf16, fp32 or auto (bench's --dtype)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from eyas.bench.stage import long_room
    from eyas.data.benchmarks import LONG, MAX_PROMPT_TOKENS, load_prompts
    from eyas.engine.loading import load_target_for
    from eyas.engine.modes import parse_modes

    modes = parse_modes(args.modes)
    target = load_target_for(args.draft, args.target, device=args.device, dtype=args.dtype)
    room = long_room(target.model.config, args.max_new_tokens, modes)
    prompts, dropped = load_prompts([LONG], target.tokenizer, args.data, args.prompts, MAX_PROMPT_TOKENS,
                                    long_prompt_tokens=room)
    if not prompts:
        raise SystemExit(f"no sharegpt-long prompts in {args.data}: dropped {dropped}")
    rows = bucket_rows(args, target, prompts, modes)
    device = next(target.model.parameters()).device
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = args.out or run_folder("long-context", machine)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context.json").write_text(json.dumps({"rows": rows, "dropped": dropped, "dtype": str(
        target.model.dtype).removeprefix("torch."), "max_new_tokens": args.max_new_tokens}, indent=1))
    (out / "long_context.md").write_text(table(rows) + "\n")
    write_run_json(out, machine, f"{len(prompts)} prompts over {len(rows)} buckets; dropped {dropped}")
    print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
