"""``eyas run CONFIG.toml``: the stages a config names, in pipeline order, each resuming its own work.

Every stage writes a subfolder of the config's ``workdir`` and the next one reads it. A rerun
skips what is done: prepare stops at a DATA_DIR already prepared with the same options, capture
keeps finished shards, training resumes RUN_DIR from its last checkpoint; export and bench are
cheap and run again.
"""

from __future__ import annotations

import time

from rich.console import Console

from eyas.config import RunConfig


def run_pipeline(config: RunConfig, console: Console) -> None:
    """Run ``config.stages`` one after the other; print where each wrote."""
    from eyas.data.prepare import AlreadyPrepared, prepare
    from eyas.data.report import print_prepare_stats

    begin = time.perf_counter()
    data, features, run, draft, report = (config.folder(s) for s in ("prepare", "capture", "train", "export", "bench"))
    console.rule(f"eyas run {config.source} — target {config.target}, stages {', '.join(config.stages)}, in {config.workdir}")
    for stage in config.stages:
        console.rule(f"eyas {stage} → {config.folder(stage)}")
        started = time.perf_counter()
        if stage == "prepare":
            options = config.options("prepare", target=config.target, out=data)
            try:
                print_prepare_stats(console, prepare(options), data)
            except AlreadyPrepared as done:
                console.print(f"[yellow]skipped:[/] {done}", soft_wrap=True)
        elif stage == "capture":
            from eyas.capture.stage import capture, describe

            console.print(describe(capture(config.options("capture", target=config.target, data=data, out=features))),
                          soft_wrap=True, highlight=False)
        elif stage == "train":
            from eyas.train.trainer import train

            online = config.sections["train"].get("online", "capture" not in config.stages)
            wired = dict(target=config.target, out=run, data=data, resume=True)
            if not online:
                wired["features"] = features
            options = config.options("train", **wired)
            options.online = online
            result = train(options)
            final = result.final_eval
            console.print(f"{result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s"
                          + (f"; holdout τ (simulated) {final['tau']:.2f}" if final else ""), soft_wrap=True)
        elif stage == "export":
            from eyas.export.stage import export_stage

            export_stage(config.options("export", run_dir=run, out=draft), console)
        elif stage == "bench":
            from eyas.bench.report import markdown
            from eyas.bench.stage import bench_stage

            has_data = (data / "manifest.json").is_file()
            result, header = bench_stage(config.options("bench", target=config.target, draft=draft, out=report,
                                                        data=data if has_data else None))
            console.print(markdown(result, header), soft_wrap=True, highlight=False)
        console.print(f"[green]{stage} done[/] in {time.perf_counter() - started:.0f} s", highlight=False)
    console.print(f"all stages done in {(time.perf_counter() - begin) / 60:.1f} min; artifacts in {config.workdir}",
                  soft_wrap=True, highlight=False)
