"""The ``eyas`` command: flags derived from the options dataclasses (``eyas.flags``); each stage command
runs its row of ``eyas.stages`` as ``eyas run`` does; the commands written out here print their own output.
Every command runs inside one error boundary (``eyas.boundary``): a user's mistake is one line and exit 2."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console

from eyas.boundary import GuardedGroup
from eyas.capture.options import CaptureOptions, StoreCheckOptions
from eyas.errors import EyasError
from eyas.flags import command
from eyas.options import CheckOptions, DemoOptions, GenerateOptions, InspectOptions, ProduceOptions, RunOptions
from eyas.stages import STAGES, exit_code

app = typer.Typer(
    help=(
        "eyas trains EAGLE-3 draft models for a target LLM and measures that they make it faster.\n\n"
        "TARGET is everywhere a hub id, a local HF directory, a .gguf file, or 'demo' "
        "(SmolLM2-135M-Instruct, offline)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=GuardedGroup,
)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _eyas(debug: bool = typer.Option(False, "--debug", help="show the traceback of an error too (or set EYAS_DEBUG=1)")):
    """The options of every command (before its name)."""


def _run_stage(name: str, options: Any) -> None:
    """Run one stage through its row of the table; a training run stopped by a signal exits 128 + its number."""
    result = STAGES[name].run(options, console)
    if exit_code(result):
        raise typer.Exit(exit_code(result))


def _stage_command(name: str) -> None:
    """``eyas NAME``: the stage's options as flags, its options class's docstring as help."""
    command(app, STAGES[name].options, name=name)(lambda options: _run_stage(name, options))


@command(app, InspectOptions)
def inspect(options: InspectOptions) -> None:
    """Print what eyas understood about TARGET: layout, sizes, layer ids in each engine's spelling.

    Reads only the config and tokenizer (of a GGUF, its header): no weights are loaded, nothing is written.
    """
    from rich.table import Table

    from eyas.target.describe import describe_target

    info = describe_target(options.target, trust_remote_code=options.trust_remote_code)
    if options.as_json:
        print(json.dumps(info.to_dict(), indent=2))
        return
    table = Table(title=f"eyas inspect {options.target}", show_header=False)
    for key, value in info.rows():
        table.add_row(key, value)
    console.print(table)


_stage_command("prepare")


@command(app, CaptureOptions, StoreCheckOptions, name="capture", loose=True)
def _capture(options: CaptureOptions, store: StoreCheckOptions) -> None:
    if store.check is not None:
        from eyas.store.check import check_store, print_check

        print_check(console, check_store(store.check, target=options.target, samples=store.check_samples,
                                         trust_remote_code=options.trust_remote_code, compute_dtype=store.check_dtype))
        return
    if not (options.target and options.data and options.out):
        raise EyasError("eyas capture needs --target, --data and --out (or --check FEATURES_DIR)")
    _run_stage("capture", options)


_stage_command("train")


@command(app, ProduceOptions)
def produce(options: ProduceOptions) -> None:
    """Feed a trainer on another host (eyas train --stream --stream-listen HOST:PORT there): capture its batches here,
    ahead of it, with HF or vLLM, and send them over gloo (TCP; GLOO_SOCKET_IFNAME picks the interface)."""
    from eyas.train.stream.remote import produce as serve

    serve(options)


_stage_command("export")


@command(app, CheckOptions)
def check(options: CheckOptions) -> None:
    """Validate a drafter directory against the contract its engines load (its family's); exit 1 on errors."""
    from eyas.export.check import check_for_target

    result = check_for_target(options.draft_dir, options.target)
    for error in result.errors:
        console.print(f"[red]error:[/] {error}", soft_wrap=True, highlight=False)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True, highlight=False)
    console.print("ok" if result.ok else f"{len(result.errors)} error(s)")
    if not result.ok:
        raise typer.Exit(1)


_stage_command("bench")


@command(app, GenerateOptions)
def generate(o: GenerateOptions) -> None:
    """Stream the target's answer to PROMPT, speculating with DRAFT_DIR; print τ and tokens/s at the end."""
    import time

    from eyas.data.benchmarks import render
    from eyas.data.render import read_chat_template, require_chat_template
    from eyas.engine.decode import generate as decode
    from eyas.engine.decode import warm_up
    from eyas.engine.loading import load_engine, load_target_for, prompt_tensor
    from eyas.engine.modes import parse_mode
    from eyas.engine.room import checked_capacity
    from eyas.target.loading import ships_chat_template

    speculation = parse_mode(o.mode)
    o.sampling().check_mode(speculation.mode)  # before anything loads
    template = read_chat_template(o.chat_template)
    require_chat_template(template, ships_chat_template(o.target))  # a GGUF's header says, before it converts
    loaded = load_target_for(o.draft, o.target, device=o.device, trust_remote_code=o.trust_remote_code, dtype=o.dtype)
    ids = render(loaded.tokenizer, o.prompt, template)
    modes = [speculation] if o.draft else []  # decoding alone drafts nothing: no draft slots, no draft positions
    capacity = checked_capacity(loaded, len(ids), o.max_new_tokens, modes)  # what fits, before any cache exists
    engine = load_engine(o.target, o.draft, capacity, o.device, o.trust_remote_code, target=loaded, graphs=o.graphs,
                         compile=o.compile, lean=o.lean, modes=modes)
    tokenizer = engine.target.tokenizer
    shown: list[int] = []
    printed = ""

    def stream(new: list[int]) -> None:
        nonlocal printed
        shown.extend(new)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    prompt = prompt_tensor(ids)
    runner = engine.target_runner
    if runner.graphs.enabled:  # recording (and compiling) the rounds first, timed apart from the answer's tok/s
        warm = warm_up(runner, [prompt], [(speculation if o.draft else None, o.sampling())], engine.draft_runner)
        err_console.print(f"warm-up ({runner.variant}): {warm:.1f} s", highlight=False)
    start = time.perf_counter()
    result = decode(engine.target_runner, prompt, o.max_new_tokens, engine.draft_runner,
                    speculation if o.draft else None, o.sampling(), engine.stop_ids,
                    None if o.as_json else stream)
    seconds = time.perf_counter() - start
    if o.as_json:
        out = {"token_ids": result.tokens, "text": tokenizer.decode(result.tokens, skip_special_tokens=True)}
        if o.draft is not None:
            out.update(tau=result.tau, rounds=result.rounds)
        print(json.dumps(out, ensure_ascii=False))
        return
    print()
    tail = f"τ {result.tau:.2f} ({speculation.label()}), " if o.draft else "no drafter, "
    err_console.print(f"{tail}{len(result.tokens)} tokens in {seconds:.1f} s = {len(result.tokens) / seconds:.1f} tok/s",
                      highlight=False)


@command(app, RunOptions)
def run(options: RunOptions) -> None:
    """Run the pipeline a config describes: prepare → (capture) → train → export → bench, into its workdir.

    Each stage resumes or skips finished work, so the same command continues a stopped run. For
    training on several GPUs, run that stage alone under torchrun (`eyas train`), then
    `eyas run CONFIG --stages export,bench`.
    """
    from eyas.config import load_config, select_stages
    from eyas.pipeline import run_pipeline

    results = run_pipeline(select_stages(load_config(options.config, options.overrides), options.stages), console)
    code = max((exit_code(result) for result in results.values()), default=0)
    if code:
        raise typer.Exit(code)


@command(app, DemoOptions)
def demo(options: DemoOptions) -> None:
    """The whole pipeline on the demo target, offline, on a CPU: prepare, capture, train online, export,
    check, bench; benches the released drafter beside this run's; ends with a table of τ and speedup of both and
    where every artifact is. About 11 minutes on two CPU cores (BENCHMARKS.md has the measured time)."""
    from eyas.demo import run_demo

    run_demo(console, options.out, options.quick, options.released)


def main() -> None:
    """Entry point for ``python -m eyas``."""
    app()
