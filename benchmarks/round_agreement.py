"""Do the engine's variants choose the same drafts on the same inputs? Rounds compared one by one, teacher-forced.

    python benchmarks/round_agreement.py --target demo --draft DRAFT_DIR [--prompts 5] [--answer-tokens 512]
        [--stride 8] [--modes chain:5,tree:60,7,10] [--variants compile,lean,compile+lean] [--dtype bf16] [--out FILE]

τ measured by decoding compares variants over *different* texts: in bf16 a variant's target rounds differently,
its greedy answer forks from the reference's at some token, and the 135 M demo target's long answers then repeat
(or not) for hundreds of tokens, which moves τ by several percent with no difference in the drafter. Here every
variant runs one round from the *same* contexts: each prompt followed by the first m tokens of the reference's
plain greedy answer, m = 0, stride, 2·stride, …; each context is prefilled by the HF forward (identical for every
variant), then one round (draft → verify → accept) runs eagerly (the reference: the model's own forward, no
compile) or through the variant (``compile``: the round under torch.compile, as the engine records it
(:func:`eyas.engine.graphs.compiled`); ``unrounded``: under a plain ``torch.compile``, which keeps what lies between
fused ops in fp32 (the engine before it kept eager's rounding); ``lean``: the fused Llama forward; compile or
unrounded with lean). Per mode and variant the table gives: rounds whose drafts equal the reference's
(a tree: the same node tokens and parents), rounds whose target argmax at the root differs, and the mean accepted
length of each over the same contexts (a teacher-forced τ: it differs only where the rounds do).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eyas.data.benchmarks import mt_bench_questions, render
from eyas.engine.decode import generate, round_for
from eyas.engine.graphs import compiled as compiled_step
from eyas.engine.loading import load_engine
from eyas.engine.modes import parse_modes, target_capacity
from eyas.speculation import Sampling
from eyas.target.loading import load_target

# a variant's compiler: as the engine compiles its rounds, or a plain torch.compile (what the engine did before)
COMPILERS = {"compile": compiled_step, "unrounded": lambda step: torch.compile(step, dynamic=False)}


def one_round(decoding_round) -> tuple[torch.Tensor, ...]:
    """Draft → verify → judge (the greedy decoder), nothing committed → (draft tokens, parents or empty, target argmax [n], accepted)."""
    decoder = decoding_round.decoder(Sampling())
    draft, _ = decoder.proposer.propose(decoding_round, None)
    logits = decoding_round.verify(draft)
    verdict = decoder.judge.judge(decoding_round, draft, logits, None, None)
    parents = draft.parents if draft.parents is not None else draft.tokens[:0]
    return draft.tokens, parents, logits.argmax(-1), verdict.accepted


def start(runner, decoding_round, context: torch.Tensor) -> None:
    """Prefill ``context`` [1, P] (the HF forward) and begin a generation after it."""
    logits, aux = runner.prefill(context)
    decoding_round.begin(context, aux, int(logits.argmax()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=512)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--modes", default="chain:5,tree:60,7,10")
    parser.add_argument("--variants", default="compile,lean,compile+lean")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    modes = parse_modes(args.modes)
    target = load_target(args.target, device=args.device, dtype=dtype)
    prompts = [torch.tensor([render(target.tokenizer, text)]) for _, text in mt_bench_questions()[: args.prompts]]
    capacity = target_capacity(max(p.shape[1] for p in prompts) + args.answer_tokens, args.answer_tokens, modes)
    reference = load_engine(args.target, args.draft, capacity, args.device, dtype=dtype, target=target, graphs=False,
                            lean=False, modes=modes)
    contexts = []
    for prompt in prompts:  # the reference's plain greedy answer: the same text for every variant
        answer = generate(reference.target_runner, prompt, args.answer_tokens, stop_ids=reference.stop_ids).tokens
        contexts += [torch.cat([prompt, torch.tensor([answer[:m]], dtype=torch.long)], dim=1)
                     for m in range(0, len(answer), args.stride)]
    print(f"{len(contexts)} contexts from {len(prompts)} prompts", flush=True)

    def rounds_of(engine, mode, wrap=lambda step: step) -> list[tuple]:
        """One round from every context; ``wrap``: how the round runs (eagerly, or compiled one way or the other)."""
        runner = engine.target_runner
        decoding_round, _ = round_for(runner, engine.draft_runner, mode)
        step = wrap(lambda: one_round(decoding_round))
        out = []
        with torch.no_grad():
            for context in contexts:
                start(runner, decoding_round, context)
                out.append(tuple(t.detach().cpu().clone() for t in step()))
        return out

    results = {}
    for mode in modes:
        began = time.perf_counter()
        ref = rounds_of(reference, mode)
        reference_tau = 1 + sum(int(r[3]) for r in ref) / len(ref)
        results[mode.label()] = {"reference": {"tau": reference_tau}}
        print(f"{mode.label()}: reference (eager, the model's forward) teacher-forced τ {reference_tau:.3f} "
              f"({time.perf_counter() - began:.0f} s)", flush=True)
        for variant in [v for v in args.variants.split(",") if v]:
            began = time.perf_counter()
            kind = set(variant.split("+"))
            reference.target_runner.close()
            engine = load_engine(args.target, args.draft, capacity, args.device, dtype=dtype, target=target,
                                 graphs=False, lean="lean" in kind, modes=modes)
            got = rounds_of(engine, mode, next((COMPILERS[k] for k in kind if k in COMPILERS), lambda step: step))
            engine.target_runner.close()
            same_drafts = sum(bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])) for a, b in zip(ref, got))
            same_root = sum(bool(a[2][0] == b[2][0]) for a, b in zip(ref, got))
            same_accept = sum(int(a[3]) == int(b[3]) for a, b in zip(ref, got))
            tau = 1 + sum(int(r[3]) for r in got) / len(got)
            results[mode.label()][variant] = {"tau": tau, "same_drafts": same_drafts, "same_root_argmax": same_root,
                                              "same_accepted": same_accept, "rounds": len(got)}
            print(f"  {variant:<14} τ {tau:.3f} ({tau / reference_tau - 1:+.2%}); drafts equal {same_drafts}/{len(got)}, "
                  f"root argmax equal {same_root}/{len(got)}, accepted equal {same_accept}/{len(got)} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
            reference = load_engine(args.target, args.draft, capacity, args.device, dtype=dtype, target=target,
                                    graphs=False, lean=False, modes=modes)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    main()
