"""Tokens/s of eyas' engine (plain, chain, tree) vs transformers' generate with a static cache, one run.

    python benchmarks/engine_speed.py --target demo --draft DRAFT_DIR [--prompts 10] [--max-new-tokens 256]
        [--modes chain:5,tree:60,7,10] [--device cuda] [--out benchmarks/results/engine_speed_<machine>_<date>.json]

MT-bench first turns, batch 1, greedy. Every decoder runs every prompt after a warm-up; the table
gives tokens/s and τ, and the ratios the engine issue sets as targets (eyas plain vs transformers
static, eyas speculative vs eyas plain). On a GPU, CUDA is synchronised around every timed call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from eyas.bench import load_engine
from eyas.bench.prompts import mt_bench_questions, render
from eyas.bench.run import parse_modes, timed
from eyas.engine.decode import generate

RESULTS = Path(__file__).with_name("results")


def hf_static(model, ids: torch.Tensor, max_new: int, stop: set[int]) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         cache_implementation="static", eos_token_id=sorted(stop), pad_token_id=sorted(stop)[0])
    return out[0, ids.shape[1]:].tolist()


def measure(device: torch.device, decode, prompts: list[torch.Tensor], warm_up: bool = True) -> dict:
    """One warm-up prompt (compilation, allocator, kernels), then every prompt timed."""
    if warm_up:
        decode(prompts[0])
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        out, elapsed = timed(device, lambda ids=ids: decode(ids))
        tokens, seconds = tokens + len(out), seconds + elapsed
        outputs.append(out)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--modes", default="chain:5,tree:60,7,10")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    modes = parse_modes(args.modes)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    engine = load_engine(args.target, args.draft, 2048, args.device, dtype=dtype)
    device = engine.target_runner.device
    tokenizer, model = engine.target.tokenizer, engine.target.model
    prompts = [torch.tensor([render(tokenizer, text)]) for _, text in mt_bench_questions()[: args.prompts]]
    # transformers first, without eyas' hooks on the model: torch.compile would trace them and recompile
    engine.target_runner.close()
    static = lambda ids: hf_static(model, ids.to(device), args.max_new_tokens, engine.stop_ids)  # noqa: E731
    for ids in prompts:  # compile once per prompt length before timing: its steady state, not its compiler
        static(ids)
    results = {"transformers static": measure(device, static, prompts, warm_up=False)}
    engine = load_engine(args.target, args.draft, 2048, args.device, dtype=dtype, target=engine.target)
    decoders = {"eyas plain": lambda ids: generate(engine.target_runner, ids, args.max_new_tokens,
                                                   stop_ids=engine.stop_ids).tokens}
    taus: dict[str, list] = {}
    for mode in modes:
        def run(ids, mode=mode):
            g = generate(engine.target_runner, ids, args.max_new_tokens, engine.draft_runner, mode, stop_ids=engine.stop_ids)
            taus.setdefault(mode.label(), []).append((sum(g.accepted), g.rounds))
            return g.tokens
        decoders[f"eyas {mode.label()}"] = run
    for name, decode in decoders.items():
        decode(prompts[0])  # warm-up, then forget its acceptance counts
        taus.clear()
        results[name] = measure(device, decode, prompts, warm_up=False)
        label = name.removeprefix("eyas ")
        if label in taus:
            accepted, rounds = map(sum, zip(*taus[label], strict=True))
            results[name]["tau"] = 1 + accepted / rounds
    plain = results["eyas plain"]
    for name, r in results.items():
        r["same_as_eyas_plain"] = sum(a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True))
        tau = f"τ {r['tau']:.2f}" if "tau" in r else ""
        print(f"{name:<24} {r['tokens_per_second']:8.1f} tok/s  {r['tokens_per_second'] / plain['tokens_per_second']:5.2f}× "
              f"eyas plain  {tau:<8} same output as eyas plain: {r['same_as_eyas_plain']}/{len(prompts)}")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = args.out or RESULTS / f"engine_speed_{machine.replace(' ', '_')}_{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine, "date": str(datetime.date.today()),
                               "torch": torch.__version__, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
