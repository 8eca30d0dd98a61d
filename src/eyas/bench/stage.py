"""The bench stage as one function over one options dataclass: what ``eyas bench`` and ``eyas run`` call."""

from __future__ import annotations

from eyas.bench.options import BenchOptions
from eyas.errors import EyasError


def bench_stage(options: BenchOptions, show_progress: bool = True):
    """Decode every prompt plainly and in every mode; write REPORT_DIR; return (result, header).

    REPORT_DIR is checked before anything runs; an interrupted run (Ctrl-C or SIGTERM) writes what it measured, marked partial,
    without manifest.json.
    """
    from eyas.bench.report import REPORT_FILES, write_report
    from eyas.bench.run import run_bench
    from eyas.data.benchmarks import load_prompts
    from eyas.data.render import read_chat_template
    from eyas.engine.acceptance import Sampling
    from eyas.engine.loading import load_engine, load_target_for
    from eyas.engine.modes import parse_modes, target_capacity
    from eyas.manifest import clear_manifest, input_record, verify_stage_dir, write_manifest
    from eyas.outputs import check_space, claim_out, input_places, refuse_other_inputs, writing
    from eyas.progress import progress_bar
    from eyas.target.facts import target_facts, target_input
    from eyas.target.loading import load_target_config

    previous = claim_out(options.out, "bench", options.force, REPORT_FILES)
    modes = parse_modes(options.modes)
    template = read_chat_template(options.chat_template)
    if options.data is not None:
        verify_stage_dir(options.data, "prepare")
    facts = target_facts(options.target, *load_target_config(options.target, options.trust_remote_code))
    inputs = [target_input(facts), input_record("draft", options.draft)]
    if options.data is not None:
        inputs.append(input_record("data", options.data))
    if previous is not None:  # the same target, drafter and data measured again replace the report; others only forced
        refuse_other_inputs(options.out, "bench", input_places(previous.get("inputs", [])), input_places(inputs),
                            options.force)
    check_space(options.out, 2**20, options.force, "the report")  # report.json, report.md, acceptance.png: well under
    target = load_target_for(options.draft, options.target, device=options.device, trust_remote_code=options.trust_remote_code)
    chosen, dropped = load_prompts(list(options.datasets), target.tokenizer, options.data, options.prompts,
                                   options.max_prompt_tokens, template)
    if not chosen:
        raise EyasError(f"no prompts left to benchmark (dropped: {dropped})")
    # caches sized to the longest chosen prompt, not to --max-prompt-tokens: static-shape attention (CUDA graphs)
    # spans the whole cache, and a multi-token step costs ~2× more over 2,048 slots than over 660 (BENCHMARKS.md)
    capacity = target_capacity(max(len(prompt.input_ids) for prompt in chosen), options.max_new_tokens, modes)
    engine = load_engine(options.target, options.draft, capacity, options.device, options.trust_remote_code,
                         target=target, graphs=options.graphs, compile=options.compile, lean=options.lean, modes=modes)
    sampling = Sampling(temperature=options.temperature, top_p=options.top_p, seed=options.seed)
    with progress_bar("bench", len(chosen), unit="prompt") as bar:
        result = run_bench(engine.target_runner, engine.draft_runner, chosen, modes, sampling, options.max_new_tokens,
                           engine.stop_ids, progress=bar if show_progress else None, repeats=options.repeats)
    header = {"target": options.target, "draft": str(options.draft), "datasets": ",".join(options.datasets),
              "dropped_prompts": dropped}
    with writing(options.out, "the measurements are lost: free space or choose another --out, then rerun"):
        clear_manifest(options.out)  # until the new report is complete, nothing claims REPORT_DIR is finished
        write_report(result, options.out, header)
        if result.partial is None:  # an interrupted run's report is not the stage's result
            write_manifest(options.out, "bench", options, inputs, REPORT_FILES, target=facts)
    return result, header
