"""Simulated τ of exported drafters on the holdouts of several DATA_DIRs: one table, every drafter on every holdout.

`eyas train` evaluates a run on its own DATA_DIR's holdout. Runs trained on different data (a data-scaling sweep:
more conversations, a second answer per prompt sampled at T = 0.8) hold out different samples, so their own τ do
not compare. Here each drafter is scored on the same holdouts — e.g. the T = 0 answers and the T = 0.8 answers of
the same held-out conversations — with the evaluation `eyas train` runs (``eyas.families.eagle3.evaluate``: training-time
test against the target's greedy choices, the target run online).

  python3 benchmarks/holdout_tau.py --target ~/stage/smollm2.gguf --draft DRAFT_DIR [DRAFT_DIR ...] \
      --data t0=DATA_DIR [t08=DATA_DIR ...] [--steps 7] [--batches 50] [--out report.json]

A held-out conversation is held out by every DATA_DIR prepared from the same conversations, with all of its answer
sets (prepare's split is a hash of the conversation's id, eyas.data.samples.conversation_of, since 96dc29e), so no
drafter trained on one of them has seen another's holdout.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target (hub id, HF directory, .gguf or 'demo')")
    parser.add_argument("--draft", nargs="+", type=Path, required=True, help="exported drafter directories")
    parser.add_argument("--data", nargs="+", required=True, help="NAME=DATA_DIR: the holdouts, each under a name")
    parser.add_argument("--steps", type=int, default=7, help="drafts per position (TTT steps K)")
    parser.add_argument("--batches", type=int, default=50, help="holdout batches per evaluation (all if 0)")
    parser.add_argument("--token-budget", type=int, default=16384, help="tokens per batch, padding included")
    parser.add_argument("--out", type=Path, help="write the table as JSON here too")
    args = parser.parse_args()

    from eyas.families.eagle3.load import load_drafter
    from eyas.target import load_target
    from eyas.train.data import OnlineSource
    from eyas.families.eagle3.evaluate import evaluate
    from eyas.train.options import TrainOptions
    from eyas.train.trainer import training_autocast

    holdouts = dict(item.split("=", 1) for item in args.data)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, device=device)
    head = target.layout.lm_head.weight.detach().to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    embed = target.layout.embed.weight.detach()
    autocast = training_autocast(device)  # the drafter's forwards as `eyas train` evaluates them
    decay = {f.name: f.default for f in fields(TrainOptions)}["step_decay"]  # weighs only the loss, not in this table
    weights = [decay**k for k in range(args.steps)]
    rows = []
    for draft in args.draft:
        drafter = load_drafter(draft, embed, target.layout.num_layers, device=device)
        draft_ids = drafter.vocabulary()
        for name, data_dir in holdouts.items():
            source = OnlineSource(target, Path(data_dir), "holdout", drafter.config.layer_ids, args.token_budget,
                                  device, torch.float32)
            result = evaluate(drafter, source, head, draft_ids, args.steps, weights, args.batches or None, autocast)
            rows.append({"draft": str(draft), "holdout": name, "tau": result["tau"],
                         "tau_answer_start": result["tau_answer_start"], "positions": result["positions"],
                         "acceptance_cumulative": result["acceptance_cumulative"]})
            print(f"{draft.name:<28} {name:<8} τ {result['tau']:.3f}  τ(answer start) {result['tau_answer_start']:.3f}  "
                  f"positions {result['positions']:,.0f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, "batches": args.batches, "holdouts": holdouts,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
