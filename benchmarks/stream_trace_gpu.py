"""Where a training run's GPU waits: a torch.profiler trace of a window of `eyas train` steps, and its gaps explained.

Issue 48's producer-thread run left the GPU idle a quarter of the time while the GIL was held for a seventh of it
(py-spy, benchmarks/results/2026-12-07_h100_capture-check). This runs any `eyas train` command with the profiler on for
steps FROM … FROM+STEPS (CUPTI: every stream's kernels and copies, and the CUDA runtime calls of every thread), then
reads the trace back and writes what the GPU did in that window:
- the share of the window in which some kernel ran (as nvidia-smi's utilisation counts it), each stream's kernel time,
  and the copies' time (copy engines);
- the longest idle gaps (no kernel on any stream) and, for each, the CUDA runtime calls in progress across it, by thread
  (a cudaStreamSynchronize, a cudaHostAlloc, an allocator's cudaFree… is the host waiting; no call at all means the
  host was busy elsewhere: Python, the GIL, the CPU's own work);
- each thread's runtime-call time by name over the window;
- each profiled thread's host waits: spans of more than 3 ms in which it ran no op and no CUDA call (blocked on a lock,
  a queue, a Python-level wait: what a profiler does not see), with the op around it and the op it ran next
  (stream-4's trace showed the trainer waiting ~32 ms a step before a compiled call, for the compile lock).

Run on the GPU machine, eyas importable (PYTHONPATH=src), the command's words after `--`:
    python3 benchmarks/stream_trace_gpu.py --from-step 30 --steps 4 --out DIR -- train --data DATA_DIR --stream \
        --stream-producer thread --target T --max-steps 40 --token-budget 32768 ...
Writes DIR/trace.json (Chrome format; gzip it before carrying it back) and DIR/gaps.json; prints the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-step", type=int, default=30, help="the first profiled step (1-based)")
    parser.add_argument("--steps", type=int, default=4, help="steps profiled")
    parser.add_argument("--gaps", type=int, default=12, help="the longest idle gaps reported")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the eyas command's words (train ...)")
    args = parser.parse_args()
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / "trace.json"
    _profile_steps(args.from_step, args.steps, trace)
    sys.argv = ["eyas", *words]
    from eyas.cli import main as eyas_main

    try:
        eyas_main()
    except SystemExit as ended:
        if ended.code not in (0, None):
            raise
    if not trace.exists():
        raise SystemExit(f"no trace: the run ended before step {args.from_step + args.steps}")
    summary = explain(json.loads(trace.read_text()), args.gaps)
    (args.out / "gaps.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("gaps", "host_waits")}, indent=1))
    print("| gap ms | starts at ms | runtime calls in progress (thread: call) |\n|---|---|---|")
    for gap in summary["gaps"]:
        calls = "; ".join(f"{c['thread']}: {c['name']} {c['ms']:.2f} ms" for c in gap["calls"]) or "none"
        print(f"| {gap['ms']:.2f} | {gap['at_ms']:.1f} | {calls} |")
    print("| thread | host waits > 3 ms (ms at ms, inside → the op run next) |\n|---|---|")
    for thread, waits in summary["host_waits"].items():
        print(f"| {thread} | " + "; ".join(f"{w['ms']:.1f} at {w['at_ms']:.1f}, in {(w['inside'] or '-')[:30]} → "
                                           f"{w['next'][:30]}" for w in waits) + " |")


def _profile_steps(first: int, count: int, trace: Path) -> None:
    """Wrap the trainer's step so that the profiler runs over steps first … first+count-1 and the trace is written."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eyas.train import trainer

    step, calls = trainer._step, {"n": 0}
    cuda = torch.cuda.is_available()  # off CUDA: a dry run of the script (no kernels to explain)
    profiler = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def profiled(*a, **k):
        calls["n"] += 1
        if calls["n"] == first:
            sync()
            profiler.start()
        out = step(*a, **k)
        if calls["n"] == first + count - 1:
            sync()
            profiler.stop()
            profiler.export_chrome_trace(str(trace))
        return out

    trainer._step = profiled


def explain(trace: dict, top: int) -> dict:
    """The window's GPU activity from a Chrome trace of torch.profiler: busy share, per-stream time, idle gaps and the
    runtime calls in progress across each."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    threads = {e["tid"]: e["args"]["name"] for e in trace.get("traceEvents", [])
               if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
    if not kernels:
        return {"kernels": 0, "gaps": [], "host_waits": {}}
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, gaps, reach = 0.0, [], start
    for kernel in kernels:  # the union of kernel intervals, and the holes in it
        finish = kernel["ts"] + kernel["dur"]
        if kernel["ts"] > reach:
            gaps.append((reach, kernel["ts"]))
            busy += kernel["dur"]
        elif finish > reach:
            busy += finish - reach
        reach = max(reach, finish)
    per_stream = defaultdict(float)
    for kernel in kernels:
        per_stream[str(kernel.get("args", {}).get("stream"))] += kernel["dur"]
    per_thread = defaultdict(lambda: defaultdict(float))
    for call in runtime:
        per_thread[threads.get(call["tid"], str(call["tid"]))][call["name"]] += call["dur"]
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    host_waits = {threads.get(tid, str(tid)): spans for tid, spans in _host_waits(events, start, end).items()}
    return {
        "window_ms": (end - start) / 1e3, "kernels": len(kernels), "busy_share": busy / (end - start),
        "kernel_ms_by_stream": {s: t / 1e3 for s, t in sorted(per_stream.items(), key=lambda x: -x[1])},
        "copy_ms": sum(e["dur"] for e in copies) / 1e3,
        "idle_ms": sum(b - a for a, b in gaps) / 1e3, "gaps_over_1ms": sum(1 for a, b in gaps if b - a > 1e3),
        "runtime_ms_by_thread": {t: {n: d / 1e3 for n, d in sorted(calls.items(), key=lambda x: -x[1])[:8]}
                                 for t, calls in per_thread.items()},
        "gaps": [{"ms": (b - a) / 1e3, "at_ms": (a - start) / 1e3,
                  "calls": [{"thread": threads.get(c["tid"], str(c["tid"])), "name": c["name"],
                             "ms": c["dur"] / 1e3} for c in runtime if c["ts"] < b and c["ts"] + c["dur"] > a]}
                 for a, b in sorted(longest)],
        "host_waits": host_waits,
    }


def _host_waits(events: list[dict], start: float, end: float, least_us: float = 3000.0) -> dict:
    """Per thread, the spans within [start, end] of more than ``least_us`` in which it began and ended no short event
    (an op or a CUDA call shorter than ``least_us``): [{"ms", "at_ms", "inside", "next"}] — the innermost longer op
    around the span (an op that waited, or one busy on the CPU, such as cuDNN building a plan) and the op run next."""
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    by_thread = defaultdict(list)
    for event in host:
        by_thread[event["tid"]].append(event)
    waits = {}
    for tid, spans in by_thread.items():
        short = sorted((e for e in spans if e["dur"] < least_us), key=lambda e: e["ts"])
        reach, found = None, []
        for event in short:
            if reach is not None and event["ts"] - reach > least_us and event["ts"] >= start and reach <= end:
                around = [e for e in spans if e["ts"] <= reach and e["ts"] + e["dur"] >= event["ts"]]
                inside = min(around, key=lambda e: e["dur"])["name"] if around else None
                found.append({"ms": (event["ts"] - reach) / 1e3, "at_ms": (reach - start) / 1e3, "inside": inside,
                              "next": event["name"]})
            reach = max(reach or event["ts"], event["ts"] + event["dur"])
        if found:
            waits[tid] = found
    return waits


if __name__ == "__main__":
    main()
