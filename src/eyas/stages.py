"""The pipeline's stages in one table: each one's options, what it writes, what eyas run wires, how it runs.

``eyas prepare|capture|train|export|bench``, ``eyas run`` and ``eyas demo`` all run a stage through
its row here, so a stage prints the same whichever way it was started. The stage modules are
imported only when a stage runs (they pull in torch); the options classes are light.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from eyas.bench.options import BenchOptions
from eyas.capture.options import CaptureOptions
from eyas.data.options import PrepareOptions
from eyas.export.options import ExportOptions
from eyas.train.options import TrainOptions


@dataclass(frozen=True)
class Stage:
    """One stage: its options (flags, config section, defaults), its folder in a workdir, and its runner."""

    options: type
    folder: str  # the subfolder of eyas run's workdir it writes (and the next stage reads)
    wired: frozenset[str]  # options eyas run sets from `target` and `workdir`; a config may not set them
    run: Callable[[Any, Console], Any]  # (options, console) → its result, printed; None when skipped
    # what eyas run checks of its options before the first stage runs, beyond their ranges (checked when they are built)
    check: Callable[[Any], None] | None = None


def _prepare(options: PrepareOptions, console: Console) -> Any:
    from eyas.data.prepare import AlreadyPrepared, prepare
    from eyas.data.report import print_prepare_stats

    try:
        stats = prepare(options)
    except AlreadyPrepared as done:
        console.print(f"[yellow]skipped, nothing to do:[/] {done}", soft_wrap=True)
        return None
    print_prepare_stats(console, stats, options.out)
    return stats


def _capture(options: CaptureOptions, console: Console) -> Any:
    from eyas.capture.stage import capture, describe

    report = capture(options)
    console.print(describe(report), soft_wrap=True, highlight=False)
    return report


def _train(options: TrainOptions, console: Console) -> Any:
    from eyas.train.trainer import train

    report = train(options)
    if report.stopped_by:
        console.print(f"stopped by {report.stopped_by} after step {report.steps}, with a checkpoint; the same command "
                      "with --resume continues (eyas run resumes by itself)", soft_wrap=True)
        return report
    first, last = report.initial_eval, report.final_eval
    console.print(f"trained {report.steps} steps ({report.tokens:,} tokens) in {report.seconds:.1f} s → {options.out}/final",
                  soft_wrap=True)
    if last and not last.get("positions", 1):
        console.print("holdout: nothing evaluated: no held-out sample has a position the drafter could be judged on (a "
                      "trained token far enough in; a whole block, for a block drafter), so its loss and τ say nothing; "
                      "hold out longer conversations (eyas prepare --holdout)", soft_wrap=True)
    elif first and last:
        console.print(f"holdout: loss {first['loss']:.3f} → {last['loss']:.3f}; step-0 acceptance "
                      f"{first['acceptance_cumulative'][0]:.3f} → {last['acceptance_cumulative'][0]:.3f}; "
                      f"simulated τ {first['tau']:.2f} → {last['tau']:.2f}" + (
                          f" (first answers' first 128 tokens: {first['tau_answer_start']:.2f} → "
                          f"{last['tau_answer_start']:.2f})" if "tau_answer_start" in last else
                          f" ({last['tau_meaning']})" if "tau_meaning" in last else "") + "".join(
                          f"; drawn chains at T = {t}: {first['tau_at_temperature'][t]:.2f} → {tau:.2f}"
                          for t, tau in last.get("tau_at_temperature", {}).items()),
                      soft_wrap=True)
    elif last:
        console.print(f"holdout: simulated τ {last['tau']:.2f}", soft_wrap=True)
    if last and last.get("predicted"):  # --predict
        from eyas.train.prediction import prediction_table

        console.print("the τ eyas bench will measure (predicted on its own prompts):\n"
                      + prediction_table(last["predicted"], last.get("predicted_by")), soft_wrap=True, markup=False)
    elif not last and report.steps:
        console.print("holdout: none, so nothing was evaluated: the training data has no holdout samples (eyas prepare "
                      "--holdout, and with a feature store eyas capture --splits train,holdout)", soft_wrap=True)
    return report


def _check_train(options: TrainOptions) -> None:
    """The drafter options against the target's config alone, as eyas train checks them before reading its weights."""
    from eyas.train.checks import check_drafter, training_device

    check_drafter(options, training_device())


def _export(options: ExportOptions, console: Console) -> Any:
    from eyas.export.stage import export_stage

    return export_stage(options, console)


def _bench(options: BenchOptions, console: Console) -> Any:
    from eyas.bench.report import markdown
    from eyas.bench.stage import bench_stage

    result, header = bench_stage(options)
    console.print(markdown(result, header), soft_wrap=True, highlight=False)
    if result.partial:
        console.print(f"{result.partial}: wrote the partial report to {options.out}/report.json, report.md, acceptance.png "
                      "(no manifest.json); the same command measures every prompt", soft_wrap=True, highlight=False)
        return result
    plots = "acceptance.png, speedup.png" if result.engines else "acceptance.png"
    console.print(f"wrote {options.out}/report.json, report.md, {plots}", soft_wrap=True, highlight=False)
    return result


STAGES: dict[str, Stage] = {  # in pipeline order
    "prepare": Stage(PrepareOptions, "data", frozenset({"target", "out"}), _prepare),
    "capture": Stage(CaptureOptions, "features", frozenset({"target", "data", "out"}), _capture),
    "train": Stage(TrainOptions, "run", frozenset({"target", "out", "data", "features", "resume"}), _train, _check_train),
    "export": Stage(ExportOptions, "draft", frozenset({"run_dir", "out"}), _export),
    "bench": Stage(BenchOptions, "bench", frozenset({"target", "draft", "out", "data"}), _bench),
}


def exit_code(result: Any) -> int:
    """The exit code a stage's result asks for: a training run stopped by a signal exits 128 + its number."""
    return getattr(result, "exit_code", 0) or 0
