"""Capture on a CUDA GPU: exactness in bf16, the guards under real CUDA graphs, and overhead.

Run on the GPU machine (see docs/architecture.md, "Measuring"):
    PYTHONPATH=src python3 benchmarks/capture_gpu.py --target demo --out results/
Prints a table and writes capture_gpu.json. Overhead is a ratio measured in one run: prefill
tokens/s with capture (states copied to pinned host memory on a side stream) over plain prefill
tokens/s (no hooks, same batch), on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eyas.errors import CaptureError
from eyas.target import capture_hidden_states, load_target
from eyas.target.verify import max_abs_diff_vs_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"

    target = load_target(args.target)
    model, layout = target.model, target.layout
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": str(next(model.parameters()).dtype),
    }

    chat = [{"role": "user", "content": "Explain speculative decoding in two sentences."}]
    ids = target.tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
    captured = capture_hidden_states(model, layout, ids)
    results["max_abs_diff_vs_hf_bf16_cuda"] = max_abs_diff_vs_hf(model, layout, ids, captured)

    results["padded_vs_alone_max_abs_diff"] = padded_vs_alone(model, layout)
    results["guards"] = guards(model, layout, ids)
    results["speed"] = speed(model, layout, args.batch, args.seq, args.iters)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    s = results["speed"]
    print(f"\n| prefill {args.batch}×{args.seq} | tokens/s | vs plain |\n|---|---|---|")
    for name in ("plain", "capture_offload", "capture_on_device"):
        print(f"| {name} | {s[name]['tokens_per_s']:,.0f} | {s[name]['tokens_per_s'] / s['plain']['tokens_per_s']:.3f} |")


def padded_vs_alone(model, layout) -> float:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 40000, (n,), generator=gen) for n in (37, 5, 64)]
    ids = torch.zeros(3, 64, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    batch = capture_hidden_states(model, layout, ids, attention_mask=mask)
    worst = 0.0
    for row, seq in enumerate(seqs):
        alone = capture_hidden_states(model, layout, seq)
        aux, final = batch.sequence(row)
        worst = max(worst, (aux.float() - alone.aux[0].float()).abs().max().item(),
                    (final.float() - alone.final[0].float()).abs().max().item())
    return worst


def guards(model, layout, ids) -> dict[str, str]:
    out = {}
    device_ids = ids.cuda()
    decoder = model.get_submodule(layout.layers_path.rpartition(".")[0])
    # 1. called while a CUDA graph is being captured
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        try:
            with torch.cuda.graph(graph):
                capture_hidden_states(model, layout, device_ids, offload=False)
            out["inside_graph_capture"] = "NOT REFUSED"
        except CaptureError as err:
            out["inside_graph_capture"] = "refused: " + str(err).splitlines()[0][:90]
    # 2. the decoder replayed from a real CUDA graph: no module runs, no hook fires
    try:
        static = device_ids.clone()
        with torch.no_grad():
            with torch.cuda.stream(stream):
                for _ in range(3):
                    decoder(input_ids=static, use_cache=False)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = decoder(input_ids=static, use_cache=False)
        original = decoder.forward

        def replay(*args, **kwargs):
            graph.replay()
            return static_out

        decoder.forward = replay
        try:
            capture_hidden_states(model, layout, ids)
            out["graph_replay"] = "NOT REFUSED"
        except CaptureError as err:
            out["graph_replay"] = "refused: " + str(err).splitlines()[1].strip()[:90]
        finally:
            decoder.forward = original
    except Exception as err:  # noqa: BLE001 — report, the other measurements still matter
        out["graph_replay"] = f"could not build the graph: {type(err).__name__}: {err}"[:200]
    # 3. torch.compile(mode="reduce-overhead") — CUDA graphs inside
    try:
        capture_hidden_states(torch.compile(model, mode="reduce-overhead"), layout, ids)
        out["compiled_reduce_overhead"] = "NOT REFUSED"
    except CaptureError as err:
        out["compiled_reduce_overhead"] = "refused: " + str(err)[:90]
    return out


def speed(model, layout, batch, seq, iters) -> dict:
    ids = torch.randint(10, 40000, (batch, seq), generator=torch.Generator().manual_seed(1)).cuda()

    def plain():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    runs = {
        "plain": plain,
        "capture_offload": lambda: capture_hidden_states(model, layout, ids, offload=True),
        "capture_on_device": lambda: capture_hidden_states(model, layout, ids, offload=False),
    }
    out = {}
    for _ in range(2):  # two rounds, interleaved, so clocks and caches treat all alike
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            out[name] = {"median_s": median, "tokens_per_s": batch * seq / median}
    return out


if __name__ == "__main__":
    main()
