"""Greedy speculative output == plain output == transformers' greedy generate, on the demo target, fp32 CPU.

    python benchmarks/lossless_cpu.py --draft DRAFT_DIR [--prompts 20] [--max-new-tokens 48] [--out FILE.json]

MT-bench first turns; eyas chain:5 and tree:60,7,10 with the given (trained) drafter and with a
random drafter of the same shape (its weights re-initialised: nothing is accepted by luck), each
compared token for token with eyas' plain decoding and with `model.generate(do_sample=False)`.
The unit tests pin the same on tiny models of ten architectures; this is the real 30-layer target.
eyas decodes through the code its CUDA graphs record (attention over the whole cache, device-built
masks, rounds in bursts, the tree grown on the device), run eagerly on the CPU. Writes the JSON (default
lossless_cpu.json in today's run folder, benchmarks/results/<date>_cpu_lossless/, with its run.json) and
exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from eyas.data.benchmarks import mt_bench_questions, render
from eyas.engine.decode import generate
from eyas.engine.loading import load_engine
from eyas.engine.modes import parse_modes
from run_record import run_folder, write_run_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--modes", default="chain:5,tree:60,7,10")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (default: under benchmarks/results)")
    args = parser.parse_args()
    torch.manual_seed(0)

    engine = load_engine(args.target, args.draft, 2048, "cpu", dtype=torch.float32)
    trained = engine.draft_runner
    model, tokenizer, new = engine.target.model, engine.target.tokenizer, args.max_new_tokens
    prompts = [torch.tensor([render(tokenizer, text)]) for _, text in mt_bench_questions()[: args.prompts]]
    random_state = {k: v.clone() for k, v in trained.drafter.state_dict().items()}
    for name, tensor in random_state.items():
        if name != "embed_tokens.weight":  # the target's embedding stays: only the drafter's own weights are random
            tensor.normal_(0, 0.02) if tensor.dim() > 1 else tensor.fill_(1.0)
    from eyas.families.eagle3.runner import DraftRunner

    random_drafter = type(trained.drafter)(trained.drafter.config, d2t=trained.drafter.d2t.cpu())
    random_drafter.load_state_dict(random_state)
    drafters = {"trained": trained, "random": DraftRunner(random_drafter.eval(), 2048)}

    engine.target_runner.close()  # transformers' generate must run without eyas' hooks
    reference = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                eos_token_id=sorted(engine.stop_ids), pad_token_id=sorted(engine.stop_ids)[0])[0, ids.shape[1]:].tolist()
                 for ids in prompts]
    engine = load_engine(args.target, args.draft, 2048, "cpu", dtype=torch.float32, target=engine.target)
    plain = [generate(engine.target_runner, ids, new, stop_ids=engine.stop_ids).tokens for ids in prompts]
    rows = {"plain == transformers generate": sum(a == b for a, b in zip(plain, reference, strict=True))}
    taus = {}
    for drafter_name, runner in drafters.items():
        for mode in parse_modes(args.modes):
            runs = [generate(engine.target_runner, ids, new, runner, mode, stop_ids=engine.stop_ids) for ids in prompts]
            rows[f"{drafter_name} {mode.label()} == plain"] = sum(r.tokens == p for r, p in zip(runs, plain, strict=True))
            taus[f"{drafter_name} {mode.label()}"] = 1 + sum(sum(r.accepted) for r in runs) / sum(r.rounds for r in runs)
    for name, same in rows.items():
        print(f"{name:<36} {same}/{len(prompts)}")
    for name, tau in taus.items():
        print(f"τ {name:<34} {tau:.3f}")
    ok = all(same == len(prompts) for same in rows.values())
    out = args.out or run_folder("lossless", "CPU") / "lossless_cpu.json"
    write_run_json(out.parent, "CPU (2 cores), fp32")
    out.write_text(json.dumps({"command": " ".join(sys.argv), "date": str(datetime.date.today()),
                               "machine": "CPU (2 cores), fp32",
                               "prompts": len(prompts), "max_new_tokens": new,
                               "identical": rows, "tau": taus, "ok": ok}, indent=1))
    print(f"{'PASS' if ok else 'FAIL'}; wrote {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
