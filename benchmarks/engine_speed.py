"""Tokens/s of eyas' engine (plain, chain, tree) vs transformers' generate with a static cache, one run.

    python benchmarks/engine_speed.py --target demo --draft DRAFT_DIR [--prompts 10] [--max-new-tokens 256]
        [--modes chain:5,tree:60,7,10] [--variants eager,graphs,compile,compile+lean] [--device cuda] [--capacity N]
        [--repeats 1] [--kernels] [--out benchmarks/results/<date>_<machine>_engine-speed/engine_speed.json]

MT-bench first turns, batch 1, greedy. Every decoder runs every prompt once untimed, then timed; the table
gives tokens/s and τ, and the ratios the engine issue sets as targets (eyas plain vs transformers
static, eyas speculative vs eyas plain of the same variant). Variants of eyas' engine: ``eager``
(no CUDA graphs), ``graphs`` (decoding steps replayed from CUDA graphs), ``compile`` (the target's
rounds fused by torch.compile, then recorded); ``+lean`` after either: Llama-family targets decode through
eyas' fused Llama forward (q/k/v and gate/up one matmul each); ``+serial``: greedy bursts one at a time, each read
back before the next is queued (the engine pipelines them); ``+sort``: a tree's proposals are chosen by a sort, as
before eyas.engine.drafting ranked them pairwise; ``+combo``: inductor's combo kernels (independent small kernels
launched as one), an experiment. On a GPU, CUDA is synchronised around every
timed call. Every decoder (transformers' included) gets a cache of ``--capacity`` slots; by default
what the run needs, as ``eyas bench`` and ``eyas generate`` size theirs: the longest prompt + the new
tokens + the most draft tokens a round verifies + 1 (static-shape attention spans the whole cache). ``--kernels``: after the
timing, each decoder's first prompt once more under the profiler — its GPU kernels by total time, and
how much of the wall time the GPU was busy; on a GPU also, for each recorded burst round, the host's time
to launch a replay against the GPU's time to run it. To see dynamo's recompilations and graph breaks,
run with ``TORCH_LOGS=recompiles,graph_breaks``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from transformers import StaticCache

from eyas.bench.run import timed
from eyas.data.benchmarks import mt_bench_questions, render
from eyas.engine import attention, drafting
from eyas.engine.burst import Burst
from eyas.engine.decode import generate
from eyas.engine.drafting import PAIRWISE_MOST
from eyas.engine.loading import load_engine
from eyas.engine.modes import parse_modes, target_capacity
from eyas.target.loading import load_target
from run_record import git_commit, run_folder, write_run_json


def hf_static(model, cache, ids: torch.Tensor, max_new: int, stop: set[int]) -> list[int]:
    """transformers' generate over a StaticCache (what ``cache_implementation="static"`` builds), which it
    compiles by default. One cache of a fixed length serves every prompt (reset in between): with a
    cache sized to each prompt, every new prompt length would recompile (and be timed compiling)."""
    cache.reset()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=max_new,
                         do_sample=False, eos_token_id=sorted(stop), pad_token_id=sorted(stop)[0])
    return out[0, ids.shape[1]:].tolist()


def measure(device: torch.device, decode, prompts: list[torch.Tensor], after_warm_up=lambda: None,
            repeats: int = 1) -> dict:
    """Every prompt decoded once untimed (compilation, recordings — each prompt length has its own prefill
    bucket —, allocator, kernels), then every prompt timed, ``repeats`` times over; tokens/s is the median
    of the repeats' rates, and each prompt's seconds are kept, so that one slow prompt or repeat shows."""
    for ids in prompts:
        decode(ids)
    after_warm_up()
    gc.collect()
    gc.freeze()  # as eyas.engine.decode.warm_up does: no collection walks the compiler's objects while timed
    rates, each, outputs = [], [], []
    with gc_watch() as gc_seconds:
        for _ in range(repeats):
            tokens, seconds, outputs = 0, 0.0, []
            for ids in prompts:
                out, elapsed = timed(device, lambda ids=ids: decode(ids))
                tokens, seconds = tokens + len(out), seconds + elapsed
                outputs.append(out)
                each.append({"tokens": len(out), "seconds": elapsed})
            rates.append(tokens / seconds)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": statistics.median(rates),
            "repeat_tokens_per_second": rates, "outputs": outputs, "per_prompt": each,
            "gc_seconds_while_timed": gc_seconds}


def tau_figures(accepted: list[list[int]], max_new_tokens: int) -> dict:
    """τ of one timed run per prompt (its accepted drafts per round), overall and per prompt, and τ over each answer's
    first 256 tokens when the answers are longer: a 135 M target's long greedy answers repeat themselves, which
    flatters τ at 512."""
    def tau(runs):
        rounds = sum(len(a) for a in runs)
        return 1 + sum(map(sum, runs)) / rounds if rounds else 1.0

    def first(run, tokens):  # the rounds that emit the first ``tokens`` (the prefill emits one)
        emitted, kept = 1, []
        for a in run:
            if emitted >= tokens:
                break
            kept.append(a)
            emitted += a + 1
        return kept

    figures = {"tau": tau(accepted), "tau_per_prompt": [round(tau([a]), 3) for a in accepted]}
    if max_new_tokens > 256:
        figures["tau_at_256"] = tau([first(a, 256) for a in accepted])
    return figures


def say(name: str, r: dict) -> None:
    repeats = ", ".join(f"{x:.1f}" for x in r["repeat_tokens_per_second"])
    tau = f", τ {r['tau']:.2f}" if "tau" in r else ""
    tau += f" (τ over the first 256 tokens {r['tau_at_256']:.2f})" if "tau_at_256" in r else ""
    print(f"{name}: {r['tokens_per_second']:.1f} tok/s{tau} (repeats {repeats}; slowest prompt "
          f"{max(p['seconds'] for p in r['per_prompt']):.3f} s; gc pauses {sum(r['gc_seconds_while_timed']):.3f} s)", flush=True)


@contextlib.contextmanager
def gc_watch():
    """Python's garbage collector's pauses while timing: a full collection over the compiler's millions of
    objects can stall decoding for a long time. Yields a list whose entries become the pauses by generation."""
    pauses = [0.0, 0.0, 0.0]
    began = [0.0]

    def callback(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[info["generation"]] += time.perf_counter() - began[0]

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def replay_cost(runner, trace_dir: Path | None = None, replays: int = 16) -> None:
    """For each recorded burst round of ``runner``: the host's time to issue ``replays`` replays against the
    GPU's time to run them. A host that needs as long to launch a round as the GPU to run it leaves the GPU
    idle. Each replay starts from the same saved state, so no cache fills up. Then the same replays under the
    profiler: kernels per round, their summed time, and the idle gaps between them inside the graph; with
    ``trace_dir``, one round's kernels in order (name, µs, gap before) go to a text file there."""
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.graphs
    for decoding_round, _ in runner.rounds.values():
        key = decoding_round.key("burst")
        if not graphs.has(key):
            continue
        label = f"{decoding_round.mode} round (width {decoding_round.width}, {decoding_round.nodes} drafts)"
        file_label = f"{decoding_round.mode}_w{decoding_round.width}_{decoding_round.nodes}"
        state = decoding_round.state
        # A pipelined burst may have ended where one more round no longer fits the cache (the decode loop queues
        # only rounds that fit): replay from a few rounds earlier, every length and position moved back alike,
        # over cache slots the same answer filled; the outcome goes to the start of the first half.
        back = min(decoding_round.width + decoding_round.target_writes, *(int(x) for x in state.lengths))
        state.lengths.sub_(back)
        state.positions.sub_(back)
        state.output_place.zero_()
        saved = state.numbers.tensor.clone()
        tensor = state.numbers.tensor

        def replay_all(tensor=tensor, saved=saved, key=key):
            for _ in range(replays):
                tensor.copy_(saved)
                graphs.replay(key)

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        host = time.perf_counter()
        start.record()
        replay_all()
        end.record()
        host = time.perf_counter() - host
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay_all()
            torch.cuda.synchronize()
        tensor.copy_(saved)
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        busy = sum(e.time_range.elapsed_us() for e in kernels) / replays
        span = (kernels[-1].time_range.end - kernels[0].time_range.start) / replays if kernels else 0.0
        print(f"    {label}: host {host / replays * 1e3:.3f} ms to issue a round, GPU {start.elapsed_time(end) / replays:.3f} "
              f"ms to run one; profiled: {len(kernels) / replays:.0f} kernels a round, busy {busy / 1e3:.3f} ms of "
              f"{span / 1e3:.3f} ms", flush=True)
        if trace_dir is not None and kernels:
            per_round = len(kernels) // replays
            one = kernels[per_round * (replays // 2): per_round * (replays // 2 + 1)]  # a middle round: warm
            lines, last_end = [], one[0].time_range.start
            for e in one:
                lines.append(f"{e.time_range.elapsed_us():8.2f} {e.time_range.start - last_end:7.2f}  {e.name[:110]}")
                last_end = e.time_range.end
            trace = trace_dir / f"round_{file_label}.txt"
            trace.write_text(f"# {label}: {per_round} kernels; columns: µs, idle µs before, kernel\n" + "\n".join(lines) + "\n")


def kernel_table(device: torch.device, decode, rows: int = 12) -> None:
    """One more decode under the profiler: its GPU kernels by total time, and the GPU's busy share of the wall."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _, wall = timed(device, decode)
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"    GPU busy {busy * 1e3:.1f} ms of {wall * 1e3:.1f} ms wall ({busy / wall:.0%})")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"    {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}×  {e.key[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--modes", default="chain:5,tree:60,7,10")
    parser.add_argument("--variants", default="graphs", help="comma-separated: eager, graphs, compile, each optionally +lean, +serial")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' static-cache generate")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--capacity", type=int, default=None, help="cache slots of every decoder (default: what the run needs)")
    parser.add_argument("--repeats", type=int, default=1, help="time every prompt this many times; report the median")
    parser.add_argument("--kernels", action="store_true", help="profile each decoder's first prompt once more")
    parser.add_argument("--attention-tiles", default=None, metavar="TILE/MERGE",
                        help="query rows per program of eyas.engine.attention's block and merge kernels (e.g. 32/32); "
                             "trees of up to 512 rows then run the kernels (default: the module's constants)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.attention_tiles:
        tile, merge = (int(x) for x in args.attention_tiles.split("/"))
        attention.TILE_ROWS, attention.MERGE_ROWS, attention.MAX_ROWS = tile, merge, 512

    modes = parse_modes(args.modes)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    target = load_target(args.target, device=args.device, dtype=dtype)
    prompts = [torch.tensor([render(target.tokenizer, text)]) for _, text in mt_bench_questions()[: args.prompts]]
    capacity = args.capacity or target_capacity(max(p.shape[1] for p in prompts), args.max_new_tokens, modes)
    print(f"cache capacity: {capacity} slots", flush=True)
    engine = load_engine(args.target, args.draft, capacity, args.device, dtype=dtype, target=target, modes=modes)
    device = engine.target_runner.device
    model = engine.target.model
    results: dict[str, dict] = {}
    if not args.no_transformers:
        # transformers first, without eyas' hooks on the model: torch.compile would trace them and recompile
        engine.target_runner.close()
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        static = lambda ids: hf_static(model, cache, ids.to(device), args.max_new_tokens, engine.stop_ids)  # noqa: E731
        # its steady state, not its compiler
        results["transformers static"] = measure(device, static, prompts, repeats=args.repeats)
        say("transformers static", results["transformers static"])
    engine.target_runner.close()
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        kind, *extras = variant.split("+")
        if kind not in ("eager", "graphs", "compile") or not set(extras) <= {"lean", "serial", "sort", "combo"}:
            parser.error(f"unknown variant {variant!r}: eager, graphs or compile, optionally +lean, +serial, +sort, +combo")
        Burst.pipelined = "serial" not in extras
        drafting.PAIRWISE_MOST = 0 if "sort" in extras else PAIRWISE_MOST
        inductor_config.combo_kernels = "combo" in extras
        engine = load_engine(args.target, args.draft, capacity, args.device, dtype=dtype, target=engine.target,
                             graphs=kind != "eager", compile=kind == "compile", lean="lean" in extras, modes=modes)
        decoders = {"plain": lambda ids, engine=engine: generate(engine.target_runner, ids, args.max_new_tokens,
                                                                  stop_ids=engine.stop_ids).tokens}
        taus: dict[str, list] = {}
        for mode in modes:
            def run(ids, mode=mode, engine=engine, taus=taus):
                g = generate(engine.target_runner, ids, args.max_new_tokens, engine.draft_runner, mode,
                             stop_ids=engine.stop_ids)
                taus.setdefault(mode.label(), []).append(list(g.accepted))
                return g.tokens
            decoders[mode.label()] = run
        for label, decode in decoders.items():
            name = f"eyas {variant} {label}"
            # τ of the timed runs only (the same in every repeat: greedy)
            results[name] = measure(device, decode, prompts, after_warm_up=taus.clear, repeats=args.repeats)
            results[name]["variant"] = variant
            results[name]["lean_forward"] = engine.target_runner.fused is not None
            if label in taus:
                results[name].update(tau_figures(taus[label][-len(prompts):], args.max_new_tokens))  # greedy: every repeat alike
            say(name, results[name])
            if args.kernels:
                kernel_table(device, lambda decode=decode: decode(prompts[0]))
        write_results(args.out, device, results)
        if args.kernels and device.type == "cuda":  # every burst round this variant recorded
            replay_cost(engine.target_runner, trace_dir=results_path(args.out, device).parent)
        engine.target_runner.close()
        del engine.target_runner, engine.draft_runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = next(name for name in results if name.startswith("eyas ") and name.endswith(" plain"))
    hf = results.get("transformers static")
    for name, r in results.items():
        plain = results[f"eyas {r['variant']} plain"] if "variant" in r else results[first]
        r["same_as_eyas_plain"] = sum(a == b for a, b in zip(r["outputs"], results[first]["outputs"], strict=True))
        r["vs_variant_plain"] = r["tokens_per_second"] / plain["tokens_per_second"]
        if hf is not None:
            r["vs_transformers_static"] = r["tokens_per_second"] / hf["tokens_per_second"]
        tau = f"τ {r['tau']:.2f}" if "tau" in r else ""
        vs_hf = f"{r['vs_transformers_static']:5.2f}× transformers static" if hf is not None else ""
        print(f"{name:<28} {r['tokens_per_second']:8.1f} tok/s  {r['vs_variant_plain']:5.2f}× its plain  {vs_hf}  "
              f"{tau:<8} same output as {first}: {r['same_as_eyas_plain']}/{len(prompts)}")
    print(f"wrote {write_results(args.out, device, results)}")


def results_path(out: Path | None, device: torch.device) -> Path:
    """``--out``, or engine_speed.json in today's run folder for this machine (benchmarks/run_record.py)."""
    return out or run_folder("engine-speed", machine_name(device)) / "engine_speed.json"


def machine_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def write_results(out: Path | None, device: torch.device, results: dict) -> Path:
    """The run's JSON and its folder's run.json, rewritten whole after every variant: a crash later in the run
    keeps what was timed."""
    machine = machine_name(device)
    out = results_path(out, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".tmp")
    partial.write_text(json.dumps({"command": " ".join(sys.argv), "commit": git_commit(), "machine": machine,
                                   "date": str(datetime.date.today()), "torch": torch.__version__, "results": results},
                                  indent=1))
    partial.replace(out)
    write_run_json(out.parent, f"{machine}; torch {torch.__version__}")
    return out


if __name__ == "__main__":
    main()
