"""The τ `eyas train --predict` predicts against the τ `eyas bench` measures, one drafter, the same prompts, one GPU.

The prediction is training's (eyas.train.prediction, eyas.families.eagle3.predict: the target answers bench's prompts as
bench decodes them, the drafter's training-time test gives each draft's chance, the rounds follow); the measurement is
bench's own loop (eyas.bench.run.run_bench: plain, then each chain) at T = 0, and at T = 1 the engine's drawn chains over
--seeds seeds a prompt, pooled (bench --samples; one seed's τ on 10 prompts is itself a draw).

  python3 benchmarks/predict_vs_bench.py --target ~/stage/smollm2.gguf --draft DRAFT_DIR --data DATA_DIR \
      [--datasets mt-bench,humaneval,sharegpt-holdout] [--prompts 10] [--tokens 256,512] [--modes chain:3,chain:5] \
      [--samples 4] [--seeds 4] [--no-compile] --out predict.json

--no-compile: the answers and the measurement both on CUDA graphs without torch.compile (bench's --no-compile), which
saves the compile warm-up; the prediction holds for whichever variant answers and measures, as long as it is the same.

--predicted RUN_DIR: no prediction here; the rows are what that `eyas train --predict` run reported (its report.json,
what its drafter's card says), each measured on the same prompts (its --predict datasets and --predict-prompts; --data:
the run's DATA_DIR, as a copy on this machine) at each of its answer lengths. --draft is that run exported.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def predicted(target, drafter, prompts, args, device) -> tuple[list[dict], str, float]:
    """Training's prediction for ``drafter`` (float32 master copy, evaluated under training's autocast) → (rows, the
    variant that answered, seconds)."""
    from eyas.data.bench_answers import answer_as_bench, bench_default
    from eyas.families.eagle3.predict import predict
    from eyas.speculation import chain_depths
    from eyas.train.data import OnlineSource
    from eyas.train.prediction import PredictionSet
    from eyas.train.setup import training_autocast

    from dataclasses import asdict

    from eyas.data.bench_answers import AnsweredPrompt

    began = time.perf_counter()
    if args.answers and args.answers.is_file():  # an earlier call's answers (the same prompts, limit and variant)
        saved = json.loads(args.answers.read_text())
        answered, decoder = [AnsweredPrompt(**a) for a in saved["answered"]], saved["decoder"]
    else:
        answered = []
        for limit in args.tokens:  # each length on its own cache, as bench's run of that length
            more, decoder = answer_as_bench(target, prompts, drafter.config.layer_ids, args.modes, limit, (0.0, 1.0),
                                            args.samples, compile=args.compile)
            answered += more
        if args.answers:
            args.answers.write_text(json.dumps({"decoder": decoder, "answered": [asdict(a) for a in answered]}))
    print(f"answered {len(answered)} in {time.perf_counter() - began:.0f} s ({decoder})", flush=True)
    source = OnlineSource(target, None, None, drafter.config.layer_ids, 32768, device, torch.float32,
                          samples=[a.sample() for a in answered])
    prediction = PredictionSet(answered, source, chain_depths(args.modes), tuple(args.tokens), bench_default("top_p"),
                               decoder)
    draft_ids = drafter.vocabulary()
    head = target.layout.lm_head.weight.detach().to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = predict(drafter, prediction, head, draft_ids, training_autocast(device))
    return rows, decoder, time.perf_counter() - began


def measured(target, draft: Path, prompts, args, limit: int) -> dict:
    """bench's loop at ``limit`` tokens and T = 0 (plain, then each chain); then, at T = 1, the --drawn chains over
    --seeds seeds a prompt, pooled, by the engine's own generate (what bench --samples runs, less its plain runs) →
    {(dataset, mode, T): {"bench": τ, "matches_plain": …}}."""
    from eyas.bench.run import run_bench
    from eyas.engine.decode import generate
    from eyas.engine.loading import load_engine
    from eyas.engine.room import checked_capacity
    from eyas.speculation import Sampling, parse_modes

    modes = parse_modes(args.modes)
    capacity = checked_capacity(target, max(len(p.input_ids) for p in prompts), limit, modes, len(prompts))
    engine = load_engine(args.target, draft, capacity, args.device, target=target, graphs=True, compile=args.compile,
                         lean=True, modes=modes)
    result = run_bench(engine.target_runner, engine.draft_runner, prompts, modes, [Sampling()], limit, engine.stop_ids)
    out = {(dataset, r.mode, 0.0): {"bench": r.tau, "matches_plain": r.matches_plain}
           for dataset, results in result.datasets.items() for r in results if r.mode != "plain"}
    for mode in parse_modes(args.drawn or args.modes):
        for dataset in dict.fromkeys(p.dataset for p in prompts):
            rounds = accepted = 0
            for seed in range(args.seeds):
                for prompt in (p for p in prompts if p.dataset == dataset):
                    g = generate(engine.target_runner, torch.tensor([prompt.input_ids]), limit, engine.draft_runner,
                                 mode, Sampling(1.0, 1.0, seed).resolved("chain"), engine.stop_ids)
                    rounds, accepted = rounds + g.rounds, accepted + sum(g.accepted)
            out[(dataset, mode.label(), 1.0)] = {"bench": 1 + accepted / max(rounds, 1)}
    engine.target_runner.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, help="DATA_DIR: its holdout for sharegpt-holdout, its training prompts kept out")
    parser.add_argument("--datasets", default="mt-bench,humaneval,sharegpt-holdout")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", default="256,512", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--modes", default="chain:3,chain:5")
    parser.add_argument("--samples", type=int, default=4, help="answers drawn per prompt at T = 1 for the prediction")
    parser.add_argument("--seeds", type=int, default=4, help="bench's --samples: seeds per prompt at T = 1, pooled")
    parser.add_argument("--drawn", help="the chains measured at T = 1 (default: every --modes)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--answers", type=Path, help="keep the target's answers here, and reuse them when it exists")
    parser.add_argument("--measure", default=None, type=lambda s: [int(x) for x in s.split(",") if x],
                        help="the answer lengths to measure (default: every --tokens; '' none: the answers only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="bf16, fp32 or auto (bench's --dtype)")
    parser.add_argument("--predicted", type=Path, help="RUN_DIR of eyas train --predict: measure what it predicted")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from eyas.data.benchmarks import MAX_PROMPT_TOKENS, load_prompts
    from eyas.engine.loading import load_target_for
    from eyas.families.eagle3.load import load_drafter

    device = torch.device(args.device)
    if args.predicted:  # the run's own prediction, as its card carries it, on its prompts: datasets, --predict-prompts
        run_options = json.loads((args.predicted / "train_options.json").read_text())
        final = json.loads((args.predicted / "report.json").read_text())["final_eval"]
        args.datasets, args.prompts = ",".join(run_options["predict"]), run_options["predict_prompts"]
        rows, decoder, seconds = final["predicted"], final.get("predicted_by"), 0.0
        args.tokens = sorted({r["max_new_tokens"] for r in rows})
        args.modes = ",".join(dict.fromkeys(r["mode"] for r in rows))
    target = load_target_for(args.draft, args.target, device=args.device, dtype=args.dtype)
    prompts, dropped = load_prompts(args.datasets.split(","), target.tokenizer, args.data, args.prompts, MAX_PROMPT_TOKENS)
    if not args.predicted:
        drafter = load_drafter(args.draft, target.layout.embed.weight.detach(), target.layout.num_layers, device=device,
                               dtype=torch.float32)
        rows, decoder, seconds = predicted(target, drafter, prompts, args, device)
        del drafter
    for row in rows:
        print(f"predicted {row['dataset']:<17} {row['mode']:<8} T {row['temperature']:g} {row['max_new_tokens']:>4}: "
              f"{row['tau']:.3f}", flush=True)
    report = {"target": args.target, "draft": str(args.draft), "prompts": args.prompts, "dropped": dropped,
              "answered_by": decoder, "prediction_seconds": round(seconds, 1), "samples": args.samples,
              "seeds": args.seeds, "predicted": rows, "rows": [],
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    args.out.write_text(json.dumps(report, indent=1, default=float))
    for limit in args.tokens if args.measure is None else args.measure:
        began = time.perf_counter()
        measure = measured(target, args.draft, prompts, args, limit)
        print(f"measured at {limit} tokens in {time.perf_counter() - began:.0f} s", flush=True)
        for row in (r for r in rows if r["max_new_tokens"] == limit):
            got = measure.get((row["dataset"], row["mode"], row["temperature"]), {})
            report["rows"].append({**row, **got})
        args.out.write_text(json.dumps(report, indent=1, default=float))
    print(f"{'dataset':<17} {'mode':<8} {'T':>3} {'tokens':>6} {'predicted':>9} {'bench':>7} {'Δ':>7}")
    for r in report["rows"]:
        bench = r.get("bench")
        diff = f"{100 * (r['tau'] / bench - 1):+6.1f}%" if bench else "      —"
        print(f"{r['dataset']:<17} {r['mode']:<8} {r['temperature']:>3g} {r['max_new_tokens']:>6} {r['tau']:>9.3f} "
              f"{bench or 0:>7.3f} {diff}")


if __name__ == "__main__":
    main()
