"""``eyas run CONFIG.toml``: the stages a config names, in pipeline order, each resuming its own work.

Every stage writes a subfolder of the config's ``workdir`` and the next one reads it. A rerun
skips what is done: prepare stops at a DATA_DIR already prepared with the same options, capture
keeps finished shards, training resumes RUN_DIR from its last checkpoint; export and bench are
cheap and run again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from eyas.config import RunConfig, spelled_for_run
from eyas.errors import EyasError
from eyas.stages import STAGES, exit_code


def run_pipeline(config: RunConfig, console: Console, overrides: bool = True) -> dict[str, Any]:
    """Run ``config.stages`` one after the other through the stage table; return each stage's result.

    A stage whose result asks for a non-zero exit (training stopped by a signal) ends the run there. With
    ``overrides`` (eyas run; not the demo, which takes none) a stage's error that names one of its flags names
    the ``--set`` override instead.
    """
    begin = time.perf_counter()
    check_stages(config, overrides)
    console.rule(f"eyas run {config.source} — target {config.target}, stages {', '.join(config.stages)}, in {config.workdir}")
    results: dict[str, Any] = {}
    for stage in config.stages:
        console.rule(f"eyas {stage} → {config.folder(stage)}")
        started = time.perf_counter()
        with _spelled_for_run(stage, overrides):
            results[stage] = STAGES[stage].run(config.options(stage), console)
        if exit_code(results[stage]):
            return results
        console.print(f"[green]{stage} done[/] in {time.perf_counter() - started:.0f} s", highlight=False)
    console.print(f"all stages done in {(time.perf_counter() - begin) / 60:.1f} min; artifacts in {config.workdir}",
                  soft_wrap=True, highlight=False)
    return results


def check_stages(config: RunConfig, overrides: bool = True) -> None:
    """Refuse, before the first stage runs, what a stage would refuse of its options when it starts: each stage's
    options are built (their ranges; training's options only other drafter families read) and checked as the stage
    checks them before reading anything large (:attr:`eyas.stages.Stage.check`: training's drafter options against the
    target's config alone), so that a mistake in training's options is not found after prepare and capture ran."""
    for stage in config.stages:
        with _spelled_for_run(stage, overrides):
            options = config.options(stage)
            if STAGES[stage].check is not None:
                STAGES[stage].check(options)


@contextmanager
def _spelled_for_run(stage: str, overrides: bool) -> Iterator[None]:
    """A stage's error that names one of its flags names the ``--set`` override instead (with ``overrides``)."""
    try:
        yield
    except EyasError as err:
        if overrides:
            err.args = (spelled_for_run(str(err), stage), *err.args[1:])
        raise
