"""Issue 23 at Kimi-K2.5's real widths on one H200: one command per measurement group, each within a 10-minute call.

    PYTHONPATH=src python3 benchmarks/kimi_scale.py capture  [--out DIR] [--tokens N]
    PYTHONPATH=src python3 benchmarks/kimi_scale.py train    [--out DIR] --mode offline|online [--attention concat,split]
    PYTHONPATH=src python3 benchmarks/kimi_scale.py export   [--out DIR]

The target is eyas.target.rehearsal's: random weights with Kimi-K2.5's text widths (61 layers, hidden 7168, MLA,
vocab 163,840, layer 0 dense) and 8 routed experts, all active (65.4 GB in bf16), built on the GPU from --seed. Its
head directory (config + embedding, lm_head, final norm: 4.7 GB) is what the stages read by path; capture and online
training take the model itself. Data: synthetic, eyas.data.synthetic (Zipf-distributed random ids over the whole
vocabulary, lengths uniform in --lengths, mean 1,728 = the seeds' 17.3 M tokens / 10,000 samples); the draft
vocabulary is their 32,000 most frequent ids. Each group writes run.json and <group>.json into --out.
benchmarks/kimi_estimate.py computes, on the CPU, what these groups should find (memory per stage, rates from FLOPs).

- capture: bare prefill (use_cache off, logits_to_keep 1) and `eyas capture` into the store in bf16 and fp8, on the
  same batches, interleaved (each capture between two prefill runs, its ratio against their mean); GPU busy share of
  each under torch.profiler; bytes per token; the disk plan for 17.3 M and 6 B tokens.
- train: the trainer's own micro-batch (eyas.families.eagle3.objective.micro_batch) and loader (Prefetcher), offline from an fp8
  store captured first, or online with the target in the loop; tokens/s after warm-up, peak memory, MFU by
  eyas.families.eagle3.flops (the formula is written out there) against 989 TFLOP/s, GPU busy share and the kernels that
  take the GPU's time (three steps under torch.profiler).
- export: `eyas train` for 2 steps from a small fp8 store, `eyas export` (bf16) and `eyas check`; sizes on disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path

import torch

from run_record import run_folder, write_run_json

SEEDS_TOKENS, LARGE_TOKENS = 17.3e6, 6e9  # the seeds' job (10,000 samples) and a published-drafter-sized run
DRAFT_VOCAB, LAYER_IDS = 32000, (2, 30, 58)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("group", choices=("capture", "train", "export"))
    parser.add_argument("--out", type=Path, default=None, help="run folder (default benchmarks/results/<date>_<machine>_kimi-<group>)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eyas-kimi"), help="scratch: head dir, data, stores, runs")
    parser.add_argument("--tokens", type=int, default=None, help="synthetic tokens (capture: 98,304; train: 8 batches, "
                        "cycled; export: 16,384)")
    parser.add_argument("--lengths", default="1024,2432", help="sample lengths, uniform between (mean 1,728)")
    parser.add_argument("--token-budget", type=int, default=None, help="per batch (capture 16,384; train 8,192)")
    parser.add_argument("--mode", choices=("offline", "online"), default="offline", help="train only")
    parser.add_argument("--steps", type=int, default=20, help="train: timed optimizer steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="train: untimed first steps (compilation, allocator)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--attention", default=None, help="train: the TTT attention(s) on the GPU, comma-separated: each timed "
                        "on the same batches in this one process (eyas.families.eagle3.ttt.ATTENTION; default: CUDA_ATTENTION)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reduced", action="store_true", help="the same run at eyas.target.rehearsal's reduced widths "
                        "(vocab 2,048, draft vocab 256): a CPU smoke run of a group before spending GPU time on it")
    args = parser.parse_args()
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = args.out or run_folder(f"kimi-{args.group}", machine)
    write_run_json(out, machine, notes="issue 23 rehearsal at Kimi-K2.5 widths; synthetic Zipf ids")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    started = time.perf_counter()
    result = {"capture": capture_group, "train": train_group, "export": export_group}[args.group](args)
    result["seconds"] = time.perf_counter() - started
    if torch.cuda.is_available():
        result["device"] = machine
    (out / f"{args.group}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    shutil.rmtree(args.work, ignore_errors=True)


# --- shared pieces ---------------------------------------------------------------------------------------------------

def lengths_of(args) -> tuple[int, int]:
    low, high = (int(x) for x in args.lengths.split(","))
    return low, high


def make_data(args, name: str, tokens: int) -> Path:
    from eyas.data.synthetic import write_random_data_dir

    low, high = lengths_of(args)
    count = max(2, round(tokens / ((low + high) / 2)))
    vocab, draft = (2048, 256) if args.reduced else (163840, DRAFT_VOCAB)
    return write_random_data_dir(args.work / name, vocab, draft, {"train": count}, (low, high), args.seed)


CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0


def make_target(args):
    """(model on the GPU, head-directory spec, loaded Target), with the build time printed."""
    from eyas.target.rehearsal import build_rehearsal_target, loaded_target, save_head_dir

    start = time.perf_counter()
    model = build_rehearsal_target("cuda" if CUDA else "cpu", torch.bfloat16 if CUDA else torch.float32, args.seed,
                                   reduced=args.reduced)
    sync()
    spec = save_head_dir(model, args.work / "target")
    print(f"target built and head dir written in {time.perf_counter() - start:.1f} s; {peak_gib():.1f} GiB on the GPU",
          flush=True)
    return model, spec, loaded_target(model, spec)


def busy_share(fn) -> dict:
    """Run ``fn`` under torch.profiler: the union of GPU kernel intervals over the wall time (the profiler's overhead
    counts against it, so the share is a lower bound)."""
    from torch.profiler import ProfilerActivity, profile

    if not CUDA:
        fn()
        return {"gpu_busy_share": None}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of intervals, µs
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda item: -item[1])[:15]  # where the GPU's time goes
    return {"gpu_busy_share": busy / 1e6 / wall, "wall_s": wall, "kernels": len(spans),
            "top_kernels": [{"name": n[:160], "ms": us / 1e3, "share_of_busy": us / busy} for n, us in top]}


def disk_plan(per_token: dict) -> dict:
    """Store sizes for the seeds' job and a 6 B-token run, per storage dtype (TB = 1e12 bytes)."""
    return {d: {"bytes_per_token": b, "seeds_17.3M_TB": b * SEEDS_TOKENS / 1e12, "run_6B_TB": b * LARGE_TOKENS / 1e12}
            for d, b in per_token.items()}


# --- capture (GPU) ---------------------------------------------------------------------------------------------------

def capture_group(args) -> dict:
    from eyas.capture.options import CaptureOptions
    from eyas.capture.stage import capture
    from eyas.data.samples import batch_inputs, read_samples
    from eyas.store.plan import plan_shards

    budget = args.token_budget or 16384
    model, spec, loaded = make_target(args)
    data = make_data(args, "data", args.tokens or 98304)
    samples = read_samples(data / "train.parquet")
    lengths = [len(s.input_ids) for s in samples]
    tokens = sum(lengths)
    plan = plan_shards(lengths, budget, 64, 1 << 60)[0]
    device = "cuda" if CUDA else "cpu"
    batches = [tuple(t.pin_memory() if CUDA else t for t in batch_inputs([samples[i] for i in b])) for b in plan.batches]

    def plain():
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids.to(device, non_blocking=True), attention_mask=mask.to(device, non_blocking=True),
                      use_cache=False, logits_to_keep=1)
        sync()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return tokens / (time.perf_counter() - start)

    def stage(dtype: str, source: Path = data, keep: bool = False) -> dict:
        out = args.work / f"features-{dtype}"
        shutil.rmtree(out, ignore_errors=True)
        report = capture(CaptureOptions(target=spec, data=source, out=out, dtype=dtype, splits=("train",), token_budget=budget),
                         loaded=loaded)
        row = {"tokens_per_s": report.tokens_written / report.capture_seconds,
               "bytes_per_token": report.bytes_written / report.tokens_written, "gib_written": report.bytes_written / 2**30}
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return row

    with torch.no_grad():  # warm-up: kernels, allocator
        model(input_ids=batches[0][0].to(device), attention_mask=batches[0][1].to(device), use_cache=False, logits_to_keep=1)
    result = {"tokens": tokens, "samples": len(samples), "batches": len(batches), "token_budget": budget,
              "peak_GiB_after_warmup": peak_gib()}
    rates = [timed(plain)]
    for dtype in ("bf16", "fp8"):
        result[f"capture_{dtype}"] = stage(dtype)
        rates.append(timed(plain))
        row = result[f"capture_{dtype}"]
        row["plain_tokens_per_s"] = (rates[-2] + rates[-1]) / 2
        row["ratio"] = row["tokens_per_s"] / row["plain_tokens_per_s"]
        print(f"capture {dtype}: {json.dumps(row)}; prefill so far {rates}", flush=True)  # seen even if the call times out
    result["plain_prefill_tokens_per_s"] = rates
    few = make_data(args, "data-profile", 4 * budget)  # the busy share over a few batches: the profiler's cost grows with kernels

    def plain_few():
        with torch.no_grad():
            for ids, mask in batches[:4]:
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, logits_to_keep=1)

    result["busy_plain"] = busy_share(plain_few)
    for dtype in ("bf16", "fp8"):
        result[f"busy_capture_{dtype}"] = busy_share(lambda d=dtype: stage(d, few))
    result["peak_GiB"] = peak_gib()
    result["disk_plan"] = disk_plan({d: result[f"capture_{d}"]["bytes_per_token"] for d in ("bf16", "fp8")})
    result["one_h200_hours_capture"] = {f"{d}_{n}": size / result[f"capture_{d}"]["tokens_per_s"] / 3600
                                        for d in ("bf16", "fp8") for n, size in (("17.3M", SEEDS_TOKENS), ("6B", LARGE_TOKENS))}
    from capture_store_gpu import _disk_speed

    result["disk_write_GiB_per_s"] = _disk_speed(args.work)
    for dtype in ("bf16", "fp8"):
        row = result[f"capture_{dtype}"]
        busy = result[f"busy_capture_{dtype}"]["gpu_busy_share"]
        print(f"| capture {dtype} | {row['tokens_per_s']:,.0f} tok/s | prefill {row['plain_tokens_per_s']:,.0f} | "
              f"ratio {row['ratio']:.3f} | {row['bytes_per_token']:,.0f} B/tok | busy {busy} |")
    return result


# --- train (GPU) -----------------------------------------------------------------------------------------------------

def train_group(args) -> dict:
    import eyas.families.eagle3.ttt as ttt
    from eyas.capture.options import CaptureOptions
    from eyas.capture.stage import capture
    from eyas.families.eagle3.flops import mfu, training_flops
    from eyas.train.data import Prefetcher
    from eyas.train.options import TrainOptions
    from eyas.families.eagle3.objective import micro_batch
    from eyas.train.trainer import setup_training, training_autocast

    attentions = (args.attention or ttt.CUDA_ATTENTION).split(",")
    budget = args.token_budget or 8192
    steps = args.warmup + args.steps
    model, spec, loaded = make_target(args)
    data = make_data(args, "data", args.tokens or 8 * budget)  # the timed steps cycle through these batches
    common = dict(target=spec, out=args.work / "unused", token_budget=budget, ttt_steps=args.ttt_steps)
    if args.mode == "offline":
        store = args.work / "features-fp8"
        start = time.perf_counter()
        capture(CaptureOptions(target=spec, data=data, out=store, dtype="fp8", splits=("train",)), loaded=loaded)
        print(f"fp8 store captured in {time.perf_counter() - start:.0f} s", flush=True)
        del model, loaded
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        options, loaded = TrainOptions(features=store, **common), None
    else:
        options = TrainOptions(data=data, online=True, **common)
    device = torch.device("cuda" if CUDA else "cpu")
    setup = setup_training(options, device, loaded)
    drafter, source, head, draft_ids = setup.drafter, setup.source, setup.head, setup.draft_ids
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=options.lr, betas=options.betas,
                                  weight_decay=options.weight_decay)  # as the trainer builds it
    weights = [options.step_decay**k for k in range(options.ttt_steps)]
    autocast = training_autocast(device)
    order = [i % len(source.batches) for i in range(steps + 3)]
    loader = Prefetcher(source)
    loader.ahead(order[:1])
    # tokens of each sample, by the positions the source's batches hold
    lengths = [len(s.input_ids) for s in source.samples] if hasattr(source, "samples") else source.store.lengths

    def measure(attention: str) -> dict:
        """Warm-up, timed steps and a profiled few with ``attention``, on the same batches as every other variant (the
        drafter goes on training from where the last variant left it: its speed does not depend on its weights)."""
        ttt.CUDA_ATTENTION = attention
        counted = {"flops": 0.0, "teacher": 0.0, "tokens": 0}

        def step(i: int, count: bool) -> None:
            tallies = tuple(torch.zeros(options.ttt_steps, device=device) for _ in range(3))
            loader.ahead(order[(i + 1) % len(order):(i + 1) % len(order) + 1])  # one step ahead, as the trainer reads
            tokens = micro_batch(drafter, loader.batch(order[i]), head, draft_ids, options, weights, autocast, tallies)
            tallies[0].cpu()  # the trainer reads the tallies back once a step
            torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), options.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if count:
                flops = training_flops(drafter.config, [lengths[j] for j in source.batches[order[i]]], options.ttt_steps)
                counted["flops"] += flops.training
                counted["teacher"] += flops.teacher
                counted["tokens"] += tokens

        if CUDA:  # from here: what training holds (offline, the target and its capture are gone)
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup):
            step(i, False)
        warmup_peak = peak_gib()
        print(f"{attention}: {args.warmup} warm-up steps done; peak {warmup_peak:.1f} GiB", flush=True)
        sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for i in range(args.warmup, steps):
            step(i, True)
        sync()
        seconds = time.perf_counter() - start
        busy = busy_share(lambda: [step(i, False) for i in range(steps, steps + 3)])
        row = {"attention": attention if CUDA else "scores", "tokens_per_s": counted["tokens"] / seconds,
               "step_s": seconds / args.steps, "peak_GiB": peak_gib(), "peak_GiB_with_warmup": warmup_peak,
               "mfu_drafter": mfu(counted["flops"], seconds), "mfu_with_teacher": mfu(counted["flops"] + counted["teacher"], seconds),
               "drafter_GFLOP_per_token": counted["flops"] / counted["tokens"] / 1e9, "busy": busy,
               "one_h200_hours_training_per_epoch": {n: size / (counted["tokens"] / seconds) / 3600
                                                     for n, size in (("17.3M", SEEDS_TOKENS), ("6B", LARGE_TOKENS))}}
        for kernel in busy.get("top_kernels", [])[:8]:
            print(f"  {kernel['share_of_busy']:6.1%}  {kernel['ms']:9.1f} ms  {kernel['name'][:110]}")
        print(f"| train {args.mode} {row['attention']} | {row['tokens_per_s']:,.0f} tok/s | MFU {row['mfu_drafter']:.1%} | "
              f"peak {row['peak_GiB']:.1f} GiB | busy {busy['gpu_busy_share']} |", flush=True)
        return row

    rows = [measure(attention) for attention in attentions]
    loader.close()
    # the first variant's figures at the top level (as before variants), every variant under "variants"
    result = {"mode": args.mode, "token_budget": budget, "ttt_steps": options.ttt_steps, "timed_steps": args.steps,
              **rows[0], "drafter_config": drafter.config.to_dict(), "variants": rows}
    for row in rows[1:]:
        print(f"{row['attention']} vs {rows[0]['attention']}: {row['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}×")
    return result


# --- export (GPU) ----------------------------------------------------------------------------------------------------

def export_group(args) -> dict:
    from eyas.capture.options import CaptureOptions
    from eyas.capture.stage import capture
    from eyas.export.check import check_draft_dir
    from eyas.export.stage import export_run
    from eyas.train.options import TrainOptions
    from eyas.train.trainer import train

    model, spec, loaded = make_target(args)
    data = make_data(args, "data", args.tokens or 16384)
    store, run, draft = args.work / "features-fp8", args.work / "run", args.work / "draft"
    capture(CaptureOptions(target=spec, data=data, out=store, dtype="fp8", splits=("train",)), loaded=loaded)
    del model, loaded
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    start = time.perf_counter()
    report = train(TrainOptions(target=spec, features=store, out=run, max_steps=2, token_budget=8192,
                                ttt_steps=args.ttt_steps, checkpoint_every=100, keep=1))
    trained = time.perf_counter() - start
    start = time.perf_counter()
    export_run(run, draft, "bf16")
    exported = time.perf_counter() - start
    start = time.perf_counter()
    check = check_draft_dir(draft)
    checked = time.perf_counter() - start

    def size(path: Path) -> int:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    weights = draft / "model.safetensors"
    config = json.loads((draft / "config.json").read_text())
    result = {"train_steps": report.steps, "train_s_with_checkpoint": trained, "export_s": exported, "check_s": checked,
              "check_ok": check.ok, "check_errors": check.errors, "check_warnings": check.warnings,
              "draft_weights_bytes": weights.stat().st_size, "draft_dir_bytes": size(draft), "run_dir_bytes": size(run),
              "config": {k: config.get(k) for k in ("hidden_size", "draft_vocab_size", "intermediate_size",
                                                    "num_attention_heads", "head_dim", "eagle_config", "target_hidden_size")}}
    print(f"| export bf16 | {weights.stat().st_size / 1e9:.2f} GB | check {'ok' if check.ok else 'FAILED'} |")
    return result


if __name__ == "__main__":
    main()
