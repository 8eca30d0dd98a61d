"""The ``eyas`` command: thin wrappers that parse flags and call the stage functions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from eyas.errors import EyasError

app = typer.Typer(
    help=(
        "eyas trains EAGLE-3 draft models for a target LLM and measures that they make it faster.\n\n"
        "TARGET is everywhere a hub id, a local HF directory, a .gguf file, or 'demo' "
        "(SmolLM2-135M-Instruct, offline)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


@app.command()
def inspect(
    target: str = typer.Argument(..., help="hub id, HF directory, .gguf file, or 'demo'"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow model code shipped with the target"),
) -> None:
    """Print what eyas understood about TARGET: layout, sizes, layer ids in each engine's spelling.

    Reads only the config (and tokenizer); no weights are loaded.
    """
    from eyas.target.describe import describe_target

    with _user_errors():
        info = describe_target(target, trust_remote_code=trust_remote_code)
    if as_json:
        print(json.dumps(info.to_dict(), indent=2))
        return
    table = Table(title=f"eyas inspect {target}", show_header=False)
    rows = [
        ("source", info.source),
        ("architecture", f"{info.architecture} (model_type {info.model_type})"),
        ("decoder layers", f"{info.layers_path}: N = {info.num_layers}"),
        ("hidden size H", str(info.hidden_size)),
        ("vocab", str(info.vocab_size)),
        ("parameters", f"{info.parameters / 1e6:,.1f} M"),
        ("token embedding", info.embed_path),
        ("final norm", info.norm_path),
        ("lm_head", info.lm_head_path),
        ("layer ids (eyas = vLLM)", f"{info.layer_ids}  (input of decoder layer L)"),
        ("  SGLang spelling", str(info.sglang_layer_ids) if info.sglang_layer_ids else "not expressible"),
        ("  SpecForge spelling", f"{info.specforge_layer_ids}  (output of layer L-1)"),
        ("chat template", {True: "present", False: "absent", None: "no tokenizer found"}[info.chat_template]),
        ("dtype", info.dtype),
        ("device plan", info.device_plan),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


@app.command()
def prepare(
    target: str = typer.Option(..., "--target", help="the target whose tokenizer and chat template render the data"),
    data: list[str] = typer.Option(
        ..., "--data", help="a .json/.jsonl/.parquet file, a folder of them, 'sharegpt' (built in) or a hub dataset; repeatable"
    ),
    out: Path = typer.Option(..., "--out", help="DATA_DIR to write"),
    max_length: int = typer.Option(2048, help="longest sample in tokens"),
    on_overflow: str = typer.Option("truncate", help="what to do with longer samples: truncate or drop"),
    holdout: float = typer.Option(0.05, help="fraction held out for evaluation (chosen by a hash of the sample id)"),
    draft_vocab_size: int = typer.Option(32000, help="draft vocabulary size Vd (identity when ≥ the target's vocabulary)"),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="a Jinja file overriding the target's template"),
    limit: int | None = typer.Option(None, help="use only the first N usable conversations"),
    regenerate: bool = typer.Option(False, "--regenerate", help="replace every assistant turn by the target's own answer"),
    server: str | None = typer.Option(None, help="OpenAI-compatible server for --regenerate (e.g. http://127.0.0.1:8000/v1)"),
    server_model: str | None = typer.Option(None, help="model name on the server (default: its first model)"),
    temperature: float = typer.Option(0.0, help="regeneration sampling temperature (0 = greedy)"),
    max_new_tokens: int = typer.Option(1024, help="longest regenerated answer"),
    concurrency: int = typer.Option(16, help="parallel requests to the server"),
    batch_size: int = typer.Option(8, help="prompts per batch when regenerating in-process"),
    static_cache: bool | None = typer.Option(None, "--static-cache/--no-static-cache",
                                             help="in-process: generate over a reused static KV cache that transformers "
                                             "compiles (default: on CUDA; each prompt-width bucket compiles once)"),
    workers: int | None = typer.Option(None, help="in-process regeneration: one worker (a copy of the target) per GPU, "
                                       "each answering every N-th conversation (default: every visible GPU)"),
    retries: int = typer.Option(3, help="retries per request (exponential backoff)"),
    timeout: float = typer.Option(300.0, help="seconds per request"),
    force: bool = typer.Option(False, "--force", help="prepare again even if DATA_DIR already holds the same result"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
) -> None:
    """Turn conversations into DATA_DIR: token ids, assistant-only loss masks, train/holdout split, draft vocab.

    Malformed records are skipped and counted (file and line); statistics are printed and saved in
    DATA_DIR/manifest.json. With --regenerate the answers come from the target itself (in-process, or
    through --server, or one worker per GPU); a killed run resumes from the journals DATA_DIR/regenerated*.jsonl.
    """
    from eyas.data.prepare import AlreadyPrepared, PrepareOptions
    from eyas.data.prepare import prepare as run_prepare
    from eyas.data.regenerate import RegenerationOptions
    from eyas.data.report import print_prepare_stats

    regeneration = RegenerationOptions(
        temperature=temperature, max_new_tokens=max_new_tokens, server=server, model=server_model,
        concurrency=concurrency, batch_size=batch_size, retries=retries, timeout=timeout, static_cache=static_cache,
    )
    options = PrepareOptions(
        target=target, data=data, out=out, max_length=max_length, overflow=on_overflow, holdout=holdout,
        draft_vocab_size=draft_vocab_size, chat_template=chat_template, limit=limit, regenerate=regenerate,
        regeneration=regeneration, workers=workers, force=force, trust_remote_code=trust_remote_code,
    )
    with _user_errors():
        try:
            stats = run_prepare(options)
        except AlreadyPrepared as done:
            console.print(f"[yellow]nothing to do:[/] {done}", soft_wrap=True)
            return
    print_prepare_stats(console, stats, out)


@app.command()
def capture(
    target: str | None = typer.Option(None, "--target", help="the target whose hidden states are captured"),
    data: Path | None = typer.Option(None, "--data", help="DATA_DIR written by eyas prepare"),
    out: Path | None = typer.Option(None, "--out", help="FEATURES_DIR to write (resumable: rerun the same command)"),
    dtype: str = typer.Option("bf16", help="storage precision: bf16, fp16, fp32, or fp8 (e4m3 + per-token scale, half of bf16)"),
    layer_ids: str | None = typer.Option(None, "--layer-ids", help="eyas layer ids, e.g. 2,15,27 (default: 2, N//2, N-3)"),
    splits: str = typer.Option("train,holdout", help="which DATA_DIR splits to capture"),
    token_budget: int = typer.Option(16384, help="tokens per forward batch, padding included"),
    max_batch: int = typer.Option(64, help="most sequences per forward batch"),
    shard_mb: int = typer.Option(256, help="approximate shard size in MiB"),
    max_gb: float | None = typer.Option(None, "--max-gb", help="cap the store size: samples beyond it are left out"),
    force: bool = typer.Option(False, "--force", help="discard an existing store / ignore the free-space check"),
    engine: str = typer.Option("hf", help="hf (in-process transformers) or vllm (vLLM's extract_hidden_states)"),
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="python of the vLLM environment (engine vllm)"),
    check: Path | None = typer.Option(None, "--check", help="verify FEATURES_DIR (checksums, counts, re-capture a few samples)"),
    check_samples: int = typer.Option(4, help="samples --check re-captures with the live target"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
) -> None:
    """Capture the target's hidden states for DATA_DIR into FEATURES_DIR (sharded safetensors).

    Estimates the bytes first and refuses when the disk is short. Killed at any moment, the same
    command resumes; under `torchrun --nproc-per-node N eyas capture ...` each rank captures its
    share of the shards (NCCL on GPUs, gloo on CPU) and rank 0 writes the manifest.
    """
    from eyas.target.layer_ids import parse_layer_ids

    with _user_errors():
        if check is not None:
            from eyas.store.check import check_store, print_check

            print_check(console, check_store(check, target=target, samples=check_samples, trust_remote_code=trust_remote_code))
            return
        if not (target and data and out):
            raise EyasError("eyas capture needs --target, --data and --out (or --check FEATURES_DIR)")
        from eyas.capture.stage import CaptureOptions, describe
        from eyas.capture.stage import capture as run_capture

        options = CaptureOptions(
            target=target, data=data, out=out, dtype=dtype, layer_ids=parse_layer_ids(layer_ids) if layer_ids else None,
            splits=tuple(s.strip() for s in splits.split(",") if s.strip()), token_budget=token_budget, max_batch=max_batch,
            shard_mb=shard_mb, max_gb=max_gb, force=force, engine=engine, vllm_python=vllm_python,
            trust_remote_code=trust_remote_code,
        )
        report = run_capture(options)
    console.print(describe(report), soft_wrap=True, highlight=False)


@app.command()
def train(
    target: str = typer.Option(..., "--target", help="the target the drafter serves"),
    out: Path = typer.Option(..., "--out", help="RUN_DIR: checkpoints, metrics.jsonl, tensorboard/, final/"),
    features: Path | None = typer.Option(None, "--features", help="FEATURES_DIR from eyas capture (offline training)"),
    data: Path | None = typer.Option(None, "--data", help="DATA_DIR from eyas prepare (with --online)"),
    online: bool = typer.Option(False, "--online", help="run the target in this process: nothing is written to disk "
                                "(the default when --data is given without --features)"),
    resume: bool = typer.Option(False, "--resume", help="continue RUN_DIR from its latest checkpoint"),
    ttt_steps: int = typer.Option(7, help="training-time-test steps K"),
    step_decay: float = typer.Option(0.8, help="weight of step k's loss is decay^k"),
    lr: float = typer.Option(1e-4, help="peak learning rate (AdamW, betas 0.9/0.95)"),
    epochs: float = typer.Option(1.0, help="passes over the training split"),
    max_steps: int | None = typer.Option(None, help="stop after this many optimizer steps"),
    token_budget: int = typer.Option(8192, help="tokens per micro-batch, padding included"),
    grad_accum: int = typer.Option(1, help="micro-batches per optimizer step"),
    warmup_ratio: float = typer.Option(0.015, help="share of steps with linear warm-up (then cosine)"),
    clip: float = typer.Option(0.5, help="gradient-norm clip"),
    checkpoint_every: int = typer.Option(500, help="optimizer steps between checkpoints (and holdout evaluations)"),
    eval_batches: int | None = typer.Option(50, help="holdout batches per evaluation (all if not given)"),
    seed: int = typer.Option(0),
    hidden_size: int | None = typer.Option(None, help="drafter width (default: the target's)"),
    fsdp: bool = typer.Option(False, "--fsdp", help="under torchrun: shard the drafter over ranks with FSDP2"),
    layer_ids: str | None = typer.Option(None, "--layer-ids", help="online only: eyas layer ids (default 2, N//2, N-3)"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
) -> None:
    """Train an EAGLE-3 drafter with training-time test, from FEATURES_DIR or online from DATA_DIR."""
    from eyas.target.layer_ids import parse_layer_ids
    from eyas.train.trainer import TrainOptions
    from eyas.train.trainer import train as run_train

    options = TrainOptions(
        target=target, out=out, features=features, data=data, online=online, resume=resume, ttt_steps=ttt_steps,
        step_decay=step_decay, lr=lr, epochs=epochs, max_steps=max_steps, token_budget=token_budget, grad_accum=grad_accum,
        warmup_ratio=warmup_ratio, clip=clip, checkpoint_every=checkpoint_every, eval_batches=eval_batches, seed=seed,
        hidden_size=hidden_size, layer_ids=parse_layer_ids(layer_ids) if layer_ids else None, trust_remote_code=trust_remote_code,
        fsdp=fsdp,
    )
    with _user_errors():
        report = run_train(options)
    if report.stopped_by:
        console.print(f"stopped by {report.stopped_by} after step {report.steps}, with a checkpoint; the same command "
                      "with --resume continues", soft_wrap=True)
        raise typer.Exit(code=report.exit_code)
    first, last = report.initial_eval, report.final_eval
    console.print(f"trained {report.steps} steps ({report.tokens:,} tokens) in {report.seconds:.1f} s → {out}/final", soft_wrap=True)
    if first and last:
        console.print(f"holdout: loss {first['loss']:.3f} → {last['loss']:.3f}; step-0 acceptance "
                      f"{first['acceptance_cumulative'][0]:.3f} → {last['acceptance_cumulative'][0]:.3f}; "
                      f"simulated τ {first['tau']:.2f} → {last['tau']:.2f} (first answers' first 128 tokens: "
                      f"{first['tau_answer_start']:.2f} → {last['tau_answer_start']:.2f})", soft_wrap=True)


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="RUN_DIR written by eyas train"),
    out: Path = typer.Option(..., "--out", help="DRAFT_DIR to write (config.json, model.safetensors, README.md)"),
    format: str = typer.Option("eagle3", "--format", help="eagle3 (SGLang and vLLM) or speculators (vLLM's own format)"),
    dtype: str = typer.Option("bf16", help="bf16 or fp16 (fp32 for tests)"),
) -> None:
    """Export a trained drafter in the EAGLE-3 format SGLang and vLLM both load, then check it."""
    from eyas.export.stage import ExportOptions, export_stage

    with _user_errors():
        export_stage(ExportOptions(run_dir=run_dir, out=out, format=format, dtype=dtype), console)


@app.command()
def check(
    draft_dir: Path = typer.Argument(..., help="a drafter directory (eyas', SpecForge's, EAGLE's, ...)"),
    target: str | None = typer.Option(None, "--target", help="the target, to check what each engine's layer ids capture"),
) -> None:
    """Validate a drafter directory against the EAGLE-3 contract both engines load; exit 1 on errors."""
    from eyas.export.check import check_draft_dir

    with _user_errors():
        model_type = layers = None
        if target:
            from eyas.target.layout import text_config
            from eyas.target.loading import load_target_config

            text = text_config(load_target_config(target)[0])
            model_type, layers = text.model_type, int(text.num_hidden_layers)
        result = check_draft_dir(draft_dir, model_type, layers)
    for error in result.errors:
        console.print(f"[red]error:[/] {error}", soft_wrap=True, highlight=False)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True, highlight=False)
    console.print("ok" if result.ok else f"{len(result.errors)} error(s)")
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def bench(
    target: str = typer.Option(..., "--target", help="the target the drafter serves"),
    draft: Path = typer.Option(..., "--draft", help="DRAFT_DIR: eyas', SpecForge's, EAGLE's or speculators' layout"),
    out: Path = typer.Option(..., "--out", help="REPORT_DIR: report.json, report.md, acceptance.png"),
    dataset: str = typer.Option("mt-bench,humaneval,sharegpt-holdout", "--dataset",
                                help="comma-separated: mt-bench, humaneval, sharegpt-holdout (needs --data)"),
    data: Path | None = typer.Option(None, "--data", help="DATA_DIR: its holdout for sharegpt-holdout; its training "
                                     "prompts are kept out of every benchmark"),
    mode: str = typer.Option("chain:5,tree:60,7,10", "--mode", help="chain:K and/or tree:TOTAL,DEPTH,TOPK, comma-separated "
                             "within, ';' or repeated ':' groups between: e.g. chain:5,tree:60,7,10"),
    temperature: float = typer.Option(0.0, help="0 = greedy (outputs are also compared with plain decoding)"),
    top_p: float = typer.Option(1.0, "--top-p"),
    prompts: int | None = typer.Option(None, "--prompts", help="the first N prompts of each dataset (all if not given)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    max_prompt_tokens: int = typer.Option(1024, "--max-prompt-tokens", help="longer prompts are skipped and counted"),
    seed: int = typer.Option(0),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when available)"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="on CUDA, replay decoding steps from CUDA graphs"),
    compile: bool = typer.Option(False, "--compile/--no-compile", help="on CUDA, fuse the target's steps with "
                                 "torch.compile before recording them (faster steps; each step shape compiles once)"),
    lean: bool = typer.Option(True, "--lean/--no-lean", help="with graphs, decode Llama-family targets through eyas' "
                              "lean forward (q/k/v and gate/up one matmul each); --no-lean: the model's own forward"),
) -> None:
    """Measure a drafter in eyas' engine: τ, acceptance per position, tokens/s speculative vs plain.

    Every prompt is decoded without speculation and in every --mode, in one run on one machine; the
    report gives each dataset's τ (1 + accepted / rounds, as vLLM counts it) and speedup.
    """
    from eyas.bench.report import markdown
    from eyas.bench.stage import BenchOptions, bench_stage

    with _user_errors():
        options = BenchOptions(
            target=target, draft=draft, out=out, datasets=tuple(d.strip() for d in dataset.split(",") if d.strip()),
            data=data, modes=mode, temperature=temperature, top_p=top_p, prompts=prompts, max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens, seed=seed, device=device, trust_remote_code=trust_remote_code,
            graphs=graphs, compile=compile, lean=lean,
        )
        result, header = bench_stage(options)
    console.print(markdown(result, header), soft_wrap=True, highlight=False)
    console.print(f"wrote {out}/report.json, report.md, acceptance.png")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the user message (the chat template is applied)"),
    target: str = typer.Option(..., "--target"),
    draft: Path | None = typer.Option(None, "--draft", help="DRAFT_DIR; without it the target decodes alone"),
    mode: str = typer.Option("chain:5", "--mode", help="chain:K or tree:TOTAL,DEPTH,TOPK"),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0, "--top-p"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    seed: int = typer.Option(0),
    device: str | None = typer.Option(None),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="on CUDA, replay decoding steps from CUDA graphs"),
    compile: bool = typer.Option(False, "--compile/--no-compile", help="on CUDA, fuse the target's steps with "
                                 "torch.compile before recording them (faster steps; each step shape compiles once)"),
    lean: bool = typer.Option(True, "--lean/--no-lean", help="with graphs, decode Llama-family targets through eyas' "
                              "lean forward (q/k/v and gate/up one matmul each); --no-lean: the model's own forward"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object at the end instead of streaming: "
                                 "token_ids (generated only), text, and with --draft tau and rounds"),
) -> None:
    """Stream the target's answer to PROMPT, speculating with DRAFT_DIR; print τ and tokens/s at the end."""
    import time

    from eyas.bench.run import parse_mode
    from eyas.data.benchmarks import render
    from eyas.engine.decode import generate as decode
    from eyas.engine.loading import load_engine, prompt_tensor
    from eyas.engine.verify import Sampling
    from eyas.target.loading import load_target

    with _user_errors():
        speculation = parse_mode(mode)
        loaded = load_target(target, device=device, trust_remote_code=trust_remote_code)
        if loaded.tokenizer is None:
            raise EyasError(f"{target} has no tokenizer: eyas generate renders PROMPT with the target's chat template")
        ids = render(loaded.tokenizer, prompt)
        # cache sized to this prompt, the answer and one round of drafts: nothing more is allocated
        capacity = len(ids) + max_new_tokens + speculation.draft_tokens + 1
        engine = load_engine(target, draft, capacity, device, trust_remote_code, target=loaded, graphs=graphs,
                             compile=compile, lean=lean)
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

        start = time.perf_counter()
        result = decode(engine.target_runner, prompt_tensor(ids), max_new_tokens, engine.draft_runner,
                        speculation if draft else None, Sampling(temperature, top_p, seed), engine.stop_ids,
                        None if as_json else stream)
        seconds = time.perf_counter() - start
    if as_json:
        out = {"token_ids": result.tokens, "text": tokenizer.decode(result.tokens, skip_special_tokens=True)}
        if draft is not None:
            out.update(tau=result.tau, rounds=result.rounds)
        print(json.dumps(out, ensure_ascii=False))
        return
    print()
    tail = f"τ {result.tau:.2f} ({speculation.label()}), " if draft else "no drafter, "
    err_console.print(f"{tail}{len(result.tokens)} tokens in {seconds:.1f} s = {len(result.tokens) / seconds:.1f} tok/s",
                      highlight=False)


@app.command()
def run(
    config: Path = typer.Argument(..., help="a TOML run config (see examples/*.toml)"),
    set_: list[str] = typer.Option([], "--set", help="override one option, e.g. --set train.lr=1e-4 (repeatable; "
                                   "over the file, which is over the defaults)"),
    stages: str | None = typer.Option(None, "--stages", help="comma-separated subset of the config's stages to run now"),
) -> None:
    """Run the pipeline a config describes: prepare → (capture) → train → export → bench, into its workdir.

    Each stage resumes or skips finished work, so the same command continues a stopped run. For
    training on several GPUs, run that stage alone under torchrun (`eyas train`), then
    `eyas run CONFIG --stages export,bench`.
    """
    from eyas.config import ConfigError, load_config
    from eyas.pipeline import run_pipeline

    with _user_errors():
        loaded = load_config(config, set_)
        if stages:
            chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
            unknown = [s for s in chosen if s not in loaded.stages]
            if unknown:
                raise ConfigError(f"--stages {stages!r}: {', '.join(unknown)} not among the config's stages "
                                  f"({', '.join(loaded.stages)})")
            loaded.stages = tuple(s for s in loaded.stages if s in chosen)
        run_pipeline(loaded, console)


@app.command()
def demo(
    out: Path = typer.Option(Path("eyas-demo"), "--out", help="where the demo writes its stage directories"),
    quick: bool = typer.Option(False, "--quick", help="every stage at smoke-test size (about a minute)"),
) -> None:
    """The whole pipeline on the demo target, offline, on a CPU: prepare, capture, train online, export,
    check, bench; ends with a table of τ and speedup and where every artifact is."""
    from eyas.demo import run_demo

    with _user_errors():
        run_demo(console, out, quick)


class _user_errors:
    """Turn EyasError into a red one-paragraph message and exit code 2 (no traceback)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if isinstance(err, EyasError):
            err_console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
            sys.exit(2)
        return False


def main() -> None:
    """Entry point for ``python -m eyas``."""
    app()
