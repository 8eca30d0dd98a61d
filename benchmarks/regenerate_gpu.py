"""Regeneration speed: eyas' batched decoding loop against transformers' generate, on ShareGPT prompts, one run.

    python benchmarks/regenerate_gpu.py --target ~/stage/smollm2.gguf [--prompts 512] [--batch-size 256]
        [--max-new-tokens 512] [--max-prompt-tokens 2048] [--temperature 0] [--generators eyas,hf-generate]
        [--passes 2] [--device cuda] [--out benchmarks/results/<date>_<machine>_regenerate]

The prompts are the first ``--prompts`` conversations of ``--data`` (default: the ShareGPT package) cut before
their first assistant turn, rendered with the target's chat template, those longer than ``--max-prompt-tokens``
left out — what ``eyas prepare --regenerate`` asks at the first depth. Each generator is
``HFGenerator`` with ``--generator`` set, exactly as prepare builds it, and answers every prompt ``--passes``
times: the first pass pays the compiling (hf-generate: torch.compile of the static cache, per shape) or the CUDA
graph recordings (eyas), later passes run warm; compile/capture time ≈ first pass − last pass (eyas also measures
its recordings directly). Reported per generator: answers/s of the first and last pass, ms per decoding step
(hf-generate: the pass's time over the batches' decoded lengths, prefills included; eyas: its steps alone, and
counted the same way), truncated answers; at T = 0 also how many greedy answers the two generators agree on and their
mean common prefix in tokens (bf16 rounding differs between the loops, so a near-tie may flip). ``--reference`` compares
each generator's answers with the first assistant turn of each ``--data`` conversation instead (e.g. a regeneration
journal made earlier by the other generator: ``--data journal.jsonl --reference``), so one generator can be checked
without running the other. Writes
``regenerate_gpu.json`` and ``run.json`` into the run folder; ``--profile N`` adds ``profile_<generator>.txt``: torch's
profiler over one more batch of N new tokens per generator, kernels sorted by device time. The ShareGPT package (120 MB) may be missing on a
device machine: choose the prompts here and carry the file (a few MB):

    python benchmarks/regenerate_gpu.py --target demo --prompts 2048 --save-prompts .stage/regen-prompts.jsonl
    # there: ... --target ~/stage/smollm2.gguf --data .stage/regen-prompts.jsonl --prompts 2048

A CPU smoke run:

    python benchmarks/regenerate_gpu.py --target demo --device cpu --prompts 4 --batch-size 2 --max-new-tokens 8 \\
        --max-prompt-tokens 256 --passes 1 --out /tmp/regen-smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from eyas.data.generators import HFGenerator
from eyas.data.options import GENERATORS, RegenerationOptions
from eyas.data.readers import read_source
from eyas.data.render import chat_ids, chat_template_for
from eyas.target.loading import load_target, load_tokenizer, resolve_target
from run_record import run_folder, write_run_json


def first_prompts(source: str, tokenizer, count: int, max_tokens: int,
                  answers: list[str] | None = None) -> list[list[dict[str, str]]]:
    """The first ``count`` conversations of ``source`` up to their first user turn, at most ``max_tokens`` rendered;
    each one's first assistant turn ('' when it has none) appended to ``answers`` when given."""
    template = chat_template_for(tokenizer, None)
    prompts = []
    for record in read_source(source):
        turns = getattr(record, "turns", None)
        if not turns:
            continue  # a skipped record
        first_user = next((n for n, t in enumerate(turns) if t.role == "user"), None)
        if first_user is None:
            continue
        messages = [{"role": t.role, "content": t.content} for t in turns[: first_user + 1]]
        if len(chat_ids(tokenizer, messages, template)) <= max_tokens:
            prompts.append(messages)
            if answers is not None:
                answers.append(next((t.content for t in turns[first_user + 1:] if t.role == "assistant"), ""))
        if len(prompts) == count:
            break
    return prompts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# benchmark-only generators: eyas' loop with its one-token attention kernel off (transformers' SDPA kernels instead)
VARIANTS = {"eyas-sdpa": "eyas"}


@contextmanager
def _variant(name: str):
    if name != "eyas-sdpa":
        yield
        return
    import eyas.engine.grouped_attention as grouped

    kernel = grouped.one_token_attention
    grouped.one_token_attention = lambda *args, **kwargs: None  # grouped_sdpa then runs SDPA
    try:
        yield
    finally:
        grouped.one_token_attention = kernel


def measure(name: str, model, tokenizer, prompts, args, device: torch.device) -> tuple[dict, list]:
    """Every pass of one generator over the prompts → (figures, the last pass's answers)."""
    options = RegenerationOptions(generator=VARIANTS.get(name, name), batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, seed=args.seed)
    generator = HFGenerator(model, tokenizer, options)
    decoded_lengths: list[int] = []
    original = model.generate

    def counted(*positional, **keywords):  # hf-generate's decoded length per batch (its steps)
        out = original(*positional, **keywords)
        decoded_lengths.append(out.shape[1] - keywords["input_ids"].shape[1])
        return out

    model.generate = counted
    passes, answers = [], []
    with _variant(name):
        try:
            for _ in range(args.passes):
                decoded_lengths.clear()
                decoder_before = _decoder_figures(generator)
                sync(device)
                started = time.perf_counter()
                answers = generator.generate(prompts)
                sync(device)
                seconds = time.perf_counter() - started
                done = [a for a in answers if not isinstance(a, Exception)]
                figures = {"seconds": round(seconds, 2), "answers": len(done), "answers_per_s": round(len(done) / seconds, 2),
                           "truncated": sum(a.truncated for a in done), "failed": len(answers) - len(done)}
                if name == "hf-generate" and decoded_lengths:
                    figures["steps"] = sum(decoded_lengths)
                    figures["ms_per_step_with_prefill"] = round(1000 * seconds / sum(decoded_lengths), 3)
                else:
                    figures.update(_decoder_delta(decoder_before, _decoder_figures(generator)))
                passes.append(figures)
                print(f"{name}: pass {len(passes)}: {json.dumps(figures)}", flush=True)
        finally:
            del model.generate  # the class's method again
    result = {"passes": passes, "first_pass_answers_per_s": passes[0]["answers_per_s"],
              "warm_answers_per_s": passes[-1]["answers_per_s"]}
    if len(passes) > 1:
        result["compile_or_capture_s"] = round(passes[0]["seconds"] - passes[-1]["seconds"], 2)
    del generator
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, answers


def profile(name: str, model, tokenizer, prompts, args, path: Path) -> None:
    """One warm batch of ``args.profile`` new tokens under torch's profiler: the kernels by device time, to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    options = RegenerationOptions(generator=name, batch_size=args.batch_size, max_new_tokens=args.profile,
                                  temperature=args.temperature, seed=args.seed)
    generator = HFGenerator(model, tokenizer, options)
    generator.generate(prompts)  # warm: graphs recorded, shapes compiled
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profiler(activities=activities) as recorded:
        generator.generate(prompts)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = recorded.key_averages().table(sort_by=sort, row_limit=30)
    path.write_text(table + "\n")
    print(f"{name}: profile of {len(prompts)} prompts × {args.profile} new tokens → {path}\n{table}", flush=True)


def _decoder_figures(generator: HFGenerator) -> dict:
    stats = getattr(generator._decoder, "stats", None)
    return dict(vars(stats)) if stats is not None else {}


def _decoder_delta(before: dict, after: dict) -> dict:
    """eyas' decoder figures of one pass (its stats are cumulative)."""
    if not after:
        return {}
    delta = {k: after[k] - before.get(k, 0) for k in after}
    steps = max(1, delta["steps"])
    return {"steps": delta["steps"], "graphs_recorded": delta["graphs"], "record_s": round(delta["record_s"], 2),
            "prefill_s": round(delta["prefill_s"], 2),
            "ms_per_step": round(1000 * (delta["decode_s"] - delta["record_s"]) / steps, 3),
            # per token a row produced (the prefill's first one included), as hf-generate's figure is counted
            "ms_per_step_with_prefill": round(1000 * (delta["decode_s"] + delta["prefill_s"]) /
                                              max(1, delta["steps"] + delta["batches"]), 3)}


def agreement(tokenizer, ours: list, theirs: list) -> dict:
    """How many answers (Answer or text) two sources share exactly, and their mean common prefix in tokens."""
    same, prefixes, compared = 0, [], 0
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(a, Exception) or isinstance(b, Exception):
            continue
        a, b = getattr(a, "text", a), getattr(b, "text", b)
        compared += 1
        same += a == b
        x, y = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        prefixes.append(next((k for k, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y))))
    return {"compared": compared, "identical": same,
            "mean_common_prefix_tokens": round(sum(prefixes) / max(1, len(prefixes)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo")
    parser.add_argument("--data", default="sharegpt", help="where the prompts come from: any source eyas prepare reads")
    parser.add_argument("--save-prompts", type=Path, default=None,
                        help="write the chosen prompts to this JSONL (then pass it as --data elsewhere) and stop")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generators", default=",".join(GENERATORS))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after measuring, profile one batch of N new tokens per generator into profile_<name>.txt")
    parser.add_argument("--reference", action="store_true",
                        help="compare every generator's answers with the first assistant turn of each --data conversation")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    names = [n.strip() for n in args.generators.split(",") if n.strip()]
    if unknown := [n for n in names if n not in GENERATORS and n not in VARIANTS]:
        parser.error(f"--generators: unknown {unknown}; choose from {', '.join([*GENERATORS, *VARIANTS])}")
    if args.passes < 1 or args.prompts < 1:
        parser.error("--passes and --prompts must be ≥ 1")

    started = time.perf_counter()
    if args.save_prompts:  # no model: the tokenizer alone measures the prompts
        tokenizer = load_tokenizer(resolve_target(args.target))
        prompts = first_prompts(args.data, tokenizer, args.prompts, args.max_prompt_tokens)
        args.save_prompts.write_text("".join(json.dumps({"id": f"p{n}", "messages": m}) + "\n" for n, m in enumerate(prompts)))
        print(f"{len(prompts)} prompts written to {args.save_prompts}")
        return
    device = torch.device(args.device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    out = args.out or run_folder("regenerate", machine)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target, device=device)
    model, tokenizer = target.model, target.tokenizer
    references: list[str] = []
    prompts = first_prompts(args.data, tokenizer, args.prompts, args.max_prompt_tokens, references)
    report = {"target": args.target, "data": args.data, "device": machine, "torch": torch.__version__, "prompts": len(prompts),
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "passes": args.passes, "setup_s": round(time.perf_counter() - started, 1), "generators": {}}
    print(f"{len(prompts)} prompts, setup {report['setup_s']} s on {machine}", flush=True)
    answers = {}
    for name in names:
        report["generators"][name], answers[name] = measure(name, model, tokenizer, prompts, args, device)
    if args.profile:
        for name in names:
            profile(name, model, tokenizer, prompts[: args.batch_size], args, out / f"profile_{name}.txt")
    if args.temperature == 0 and len(answers) == 2:
        report["greedy_agreement"] = agreement(tokenizer, *answers.values())
    if args.reference:
        report["reference_agreement"] = {name: agreement(tokenizer, ours, references) for name, ours in answers.items()}
    if len(names) == 2 and "eyas" in names:  # eyas over the other one
        other = next(n for n in names if n != "eyas")
        eyas, them = (report["generators"][n]["warm_answers_per_s"] for n in ("eyas", other))
        report["warm_speedup"] = round(eyas / them, 2) if them else None
    (out / "regenerate_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    write_run_json(out, machine, notes="eyas' batched loop vs transformers' generate for regeneration")
    print(f"\n{'generator':<12} {'first pass ans/s':>17} {'warm ans/s':>11} {'compile/capture s':>18} "
          f"{'ms/step':>8} {'ms/step with prefill':>21}")
    for name, result in report["generators"].items():
        last = result["passes"][-1]
        print(f"{name:<12} {result['first_pass_answers_per_s']:>17} {result['warm_answers_per_s']:>11} "
              f"{result.get('compile_or_capture_s', '-'):>18} {last.get('ms_per_step', '-'):>8} "
              f"{last.get('ms_per_step_with_prefill', '-'):>21}")
    for key in ("greedy_agreement", "reference_agreement", "warm_speedup"):
        if key in report:
            print(f"{key}: {report[key]}")
    print(f"written: {out}/regenerate_gpu.json, run.json")


if __name__ == "__main__":
    main()
