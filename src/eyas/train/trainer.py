"""``eyas train``: the drafter, trained offline or online, resumable.

One loop: a batch (from FEATURES_DIR, captured now by the target, or streamed by a producer: :mod:`eyas.train.stream`)
→ the drafter family's micro-batch (its forward, loss and backward: :mod:`eyas.families`) → AdamW (β 0.9/0.95, clip
0.5, linear warm-up then cosine: :mod:`eyas.train.schedule`) → metrics, checkpoints, the family's holdout evaluation.
bf16 autocast with fp32 master weights on GPU, fp32 on CPU.

:func:`train` is its parts in order: where the run starts (:func:`_resume_point`: --out claimed, the checkpoint to
resume), what it trains with (:func:`_start`; the drafter, data and teacher come from :mod:`eyas.train.setup`), where it
stands (:func:`_restore`), the steps (:func:`_steps`: each :func:`_step`, its metrics line and checkpoint), and the
final weights (:func:`_finish`). The run's state between them is one :class:`_Run`; its log is
:mod:`eyas.train.metrics`, an early stop on request :mod:`eyas.train.stop`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eyas import families
from eyas.distributed import all_reduce_sum, barrier, init_distributed
from eyas.errors import EyasError
from eyas.out_lock import one_writer
from eyas.outputs import StageOut
from eyas.progress import progress_bar
from eyas.train.stream.source import StreamEnded
from eyas.train.checks import check_drafter
from eyas.train.checkpoint import (checkpoint_state, full_model_state, latest_checkpoint, load_checkpoint, run_bytes,
                                   save_checkpoint)
from eyas.train.data import Prefetcher, batch_seed, batches_forever
from eyas.train.metrics import Metrics
from eyas.train.options import TrainOptions, trains_online
from eyas.train.resume import new_record, read_run_record, resume_changes, resumed_record, target_identity
from eyas.train.run_dir import MARKERS as RUN_MARKERS
from eyas.train.run_dir import OPTIONS_FILE, clear_run_dir, finish_run_dir, start_run_dir
from eyas.train.schedule import optimizer_and_schedule
from eyas.train.setup import TrainingSetup, setup_training, training_autocast
from eyas.train.stop import StopRequests

__all__ = ["TrainReport", "TrainOptions", "setup_training", "train", "training_autocast"]


@dataclass
class TrainReport:
    """What a run ended with: steps, tokens and seconds over all its segments (a resumed run counts those before it)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    resumed_from: int | None = None  # the step this segment resumed from
    stopped_by: str | None = None  # the signal that ended the run early, after a checkpoint ("SIGTERM")
    exit_code: int = 0  # for the command line: 128 + that signal's number
    final_eval: dict = field(default_factory=dict)
    initial_eval: dict = field(default_factory=dict)


@dataclass
class _Resume:
    """Where a run starts: the checkpoint it resumes from (None: step 0), its step, the run's record beside it, and
    whether --force starts an existing run over."""

    latest: Path | None
    at: int
    recorded: dict | None
    start_over: bool
    out: StageOut


@dataclass
class _Run:
    """A run's state as its steps advance, shared by the named parts of :func:`train`."""

    options: TrainOptions
    out: Path
    rank: int
    world: int
    device: torch.device
    setup: TrainingSetup
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    weights: list[float]  # each tally's weight in the step's loss (the family's: per TTT step, block slot, …)
    report: TrainReport = field(default_factory=TrainReport)
    metrics: Metrics | None = None  # rank 0's log
    step: int = 0
    epoch: int = 0
    index: int = 0
    record: dict = field(default_factory=dict)  # the last step's metrics (a resumed run starts from its checkpoint's)
    earlier_seconds: float = 0.0  # the segments before this one
    counted: float | None = 0.0  # positions the loss counted over the whole run (None: a checkpoint older than the count)
    run_record: dict = field(default_factory=dict)  # run.json: the options and segments (new, or the resumed one's)

    @property
    def lead(self) -> bool:
        """Rank 0 evaluates, logs and writes checkpoints."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.options.fsdp and self.world > 1

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step, over all ranks."""
        return self.options.grad_accum * self.world

    @property
    def autocast(self):
        return training_autocast(self.device)

    def evaluation(self) -> dict:
        """Holdout acceptance and simulated τ of the drafter as it is now."""
        return self.setup.family.evaluate(self.setup, self.options, self.weights, self.autocast)

    @property
    def evaluates(self) -> bool:
        """Whether this rank evaluates: rank 0, or every rank of a sharded drafter; only with a holdout."""
        return self.setup.holdout is not None and (self.lead or self.sharded)


@one_writer("train", lambda options, *_, **__: options.out)
def train(options: TrainOptions, loaded=None) -> TrainReport:
    """Run (or resume) training; returns the report, also written to RUN_DIR/report.json. ``loaded``: for --online, the
    target already in memory (see :func:`setup_training`)."""
    torch.manual_seed(options.seed)
    rank, world, device = init_distributed()
    # 1. --out is checked, and a resume judged against the run's record, before the target is loaded or anything is written
    resume = _resume_point(options, rank == 0)
    run = _start(options, loaded, resume, rank, world, device)
    try:
        # 2. the run's directory, and where the run stands: from the checkpoint, or a first evaluation at step 0
        _restore(run, resume)
        # 3. the steps, each with its metrics line, and a checkpoint every --checkpoint-every steps or when asked to stop
        _steps(run)
        # 4. the final weights and report.json, unless a stop request ended the run early (then --resume continues it)
        return _finish(run)
    finally:
        run.setup.close()  # a stream's producer stops with the run


def _resume_point(options: TrainOptions, lead: bool) -> _Resume:
    """Claim --out (rank 0) and find the checkpoint a run resumes from; a run already there needs --resume or --force."""
    out = Path(options.out)
    stage_out = StageOut.claim("train", out, options.force, RUN_MARKERS) if lead else \
        StageOut("train", out, options.force, None)  # other ranks leave the directory to rank 0
    latest = latest_checkpoint(out)
    start_over = latest is not None and not options.resume
    if start_over and not options.force:
        raise EyasError(f"{out} already holds a run (checkpoint {latest.name}); pass --resume to continue it, --force "
                        "to start it over, or use another --out")
    if start_over:  # --force: a new run (the old one's files are removed just before it writes its own)
        latest = None
    if options.resume and latest is None and lead:
        print(_nothing_to_resume(out), flush=True)
    at = checkpoint_state(latest)["step"] if latest is not None else 0
    return _Resume(latest, at, read_run_record(out) if latest is not None else None, start_over, stage_out)


def _nothing_to_resume(out: Path) -> str:
    """The note --resume prints when RUN_DIR has no checkpoint: the run starts at step 0. A note, not a refusal: the
    same command is meant to start a run and continue it (a job queue's resubmissions, torchrun in docs/recipe.md, and
    eyas run, which always resumes)."""
    if (out / OPTIONS_FILE).is_file():
        return f"--resume: {out} holds no checkpoint yet (its run stopped before the first): starting it at step 0"
    return f"--resume: {out} holds no run to resume (no {OPTIONS_FILE}, no checkpoint): starting a new run"


def _start(options: TrainOptions, loaded, resume: _Resume, rank: int, world: int, device: torch.device) -> _Run:
    """The drafter, its data and teacher, the optimizer and schedule, and the run's record (new or resumed), after every
    check that can refuse the run."""
    out = Path(options.out)
    check_drafter(options, device, world)  # before the target's weights are read: the family's validation, memory
    if options.stream and world > 1:
        raise EyasError("--stream feeds one training process: run eyas train --stream without torchrun (the producer "
                        "may use other GPUs: --producer-device), or capture a store and train from it under torchrun")
    target = target_identity(options)
    changes = resume_changes(resume.recorded, options, resume.at, out, target, world) if resume.recorded is not None else {}
    setup = setup_training(options, device, loaded, target)
    drafter = setup.drafter
    family = setup.family
    if options.fsdp and not family.shardable:
        raise EyasError(f"--fsdp does not shard {family.name} drafters: train without it (--drafter {family.name})")
    if rank == 0:
        resume.out.need(run_bytes(out, drafter, options.keep), "training (checkpoints, final weights)",
                        ", keep fewer checkpoints with --keep")
    if options.fsdp and world > 1:
        family.shard(drafter)
    per_step = options.grad_accum * world
    total_steps = options.max_steps or max(1, math.ceil(options.epochs * len(setup.source.batches) / per_step))
    if resume.at > total_steps:
        raise EyasError(f"{out} is at step {resume.at}, past the {total_steps} steps --max-steps/--epochs now give: give "
                        f"at least --max-steps {resume.at}, or train into a new --out")
    optimizer, scheduler = optimizer_and_schedule(drafter.trainable_parameters(), options, total_steps)
    weights = family.tally_weights(options, drafter)  # one per tally a step adds up: TTT step, block slot, …
    record = new_record(options, target, world) if resume.recorded is None else \
        resumed_record(resume.recorded, options, resume.at, changes, resume.at < total_steps, target, world)
    return _Run(options, out, rank, world, device, setup, optimizer, scheduler, total_steps, weights, run_record=record)


def _restore(run: _Run, resume: _Resume) -> None:
    """Write the run's directory (rank 0) and put the run where it stands: the checkpoint's weights, optimizer, data
    position and totals, or at step 0 the drafter's first evaluation."""
    state: dict = {}
    if resume.start_over and run.lead:
        clear_run_dir(run.out)
    if resume.latest is not None:
        state = load_checkpoint(resume.latest, run.setup.drafter, run.optimizer, run.scheduler)
        run.step, run.epoch, run.index = state["step"], state["position"]["epoch"], state["position"]["index"]
        run.record = state.get("record", {})  # a finished run resumed runs no step: its final record is the checkpoint's
        run.report.resumed_from = run.step
    barrier()  # every rank has read the checkpoint before rank 0 may write a new one
    if run.lead:
        run.out.mkdir(parents=True, exist_ok=True)
        start_run_dir(run.out, run.run_record, run.setup.drafter.config.to_dict(), run.setup.target)
        run.metrics = Metrics(run.out, keep_up_to=run.step if resume.latest is not None else -1)
    report = run.report
    if resume.latest is not None:  # the totals of the segments before this one (from the run's log if the checkpoint is older)
        logged = run.metrics.lines if run.metrics else []
        report.tokens = state.get("tokens", sum(line.get("tokens", 0) for line in logged))
        report.seconds = state.get("seconds", 0.0)
        counted = state.get("counted")  # absent from older checkpoints: not known, not checked
        run.counted = float(counted) if isinstance(counted, (int, float)) and not isinstance(counted, bool) else None
        report.initial_eval = state.get("initial_eval", next((line["eval"] for line in logged if line["step"] == 0
                                                              and "eval" in line), {}))
    run.earlier_seconds = report.seconds
    if run.step == 0 and run.evaluates:  # a sharded drafter evaluates on every rank
        report.initial_eval = run.evaluation()
        if run.lead:
            run.metrics.write({"step": 0, "eval": report.initial_eval})


def _steps(run: _Run) -> None:
    """Optimizer steps until the last one or a stop request, every rank walking the same global order of batches (each
    takes its share); shards are read one optimizer step ahead, on a thread."""
    options, world, rank = run.options, run.world, run.rank
    started, segment_tokens = time.perf_counter(), 0
    run.setup.drafter.train()
    stream = batches_forever(run.setup.source, options.seed, run.epoch, run.index)
    bar_name = "train" if world == 1 else f"train (rank {rank}/{world})"
    with StopRequests() as stop, progress_bar(bar_name, total=run.total_steps, unit="step") as bar, \
            contextlib.closing(Prefetcher(run.setup.source)) as loader:
        if hasattr(run.setup.source, "start"):  # a stream: its producer captures from this data position on
            run.setup.source.start(options.seed, run.epoch, run.index, rank, world)
        upcoming = [next(stream) for _ in range(run.per_step)]
        loader.ahead(i for _, _, i in upcoming[rank::world])
        bar(run.step)
        while run.step < run.total_steps:
            global_items = upcoming  # every rank walks the same global order
            upcoming = [next(stream) for _ in range(run.per_step)]
            loader.ahead(i for _, _, i in upcoming[rank::world])
            before = run.epoch, run.index
            run.epoch, run.index = global_items[-1][0], global_items[-1][1]  # data position after this step
            try:
                tokens, tallies, grad_norm = _step(run, loader, global_items[rank::world])
            except StreamEnded as ended:  # no batch will come: what the finished steps trained is kept
                run.epoch, run.index = before
                raise EyasError(_stream_ended(run, ended, time.perf_counter() - started)) from None
            segment_tokens += tokens
            accuracy = _record(run, tokens, tallies, grad_norm, segment_tokens / max(time.perf_counter() - started, 1e-9))
            run.record["data_wait_s"] = waited = loader.waited  # this segment's so far: what reading or a producer cost
            _check_learning(run)
            stopping = stop.agreed() and run.step < run.total_steps  # every rank stops after the same step
            try:
                _log_and_checkpoint(run, stopping, time.perf_counter() - started)
            except StreamEnded as ended:  # its holdout never came: the step is kept, unevaluated
                if run.lead:
                    run.metrics.write(run.record)
                raise EyasError(_stream_ended(run, ended, time.perf_counter() - started)) from None
            bar(1)
            share = waited / max(time.perf_counter() - started, 1e-9)  # shown once it matters (a slow disk or producer)
            bar.note(f"loss {run.record['loss']:.3f} acc₀ {accuracy[0]:.3f} {run.record['tokens_per_s']:,.0f} tok/s"
                     + (f", {share:.0%} waiting for data" if share >= 0.05 else ""))
            if stopping:
                run.report.stopped_by, run.report.exit_code = stop.signal_name, stop.exit_code
                break
    run.report.steps = run.step
    run.report.seconds = run.earlier_seconds + time.perf_counter() - started


def _step(run: _Run, loader, mine: list) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One optimizer step over this rank's micro-batches ``mine``; gradients averaged over ranks → (tokens over all
    ranks, the step's (losses, hits, counted) tallies read back, the gradient norm before clipping)."""
    options, setup, world = run.options, run.setup, run.world
    # Tallies stay on the device until the step ends: reading one back per TTT step would make the
    # host wait for the GPU 21 times a batch instead of queueing the next kernels.
    losses = torch.zeros(len(run.weights), device=run.device)
    correct, counted, tokens = torch.zeros_like(losses), torch.zeros_like(losses), 0
    for item_epoch, item_index, batch_index in mine:
        tokens += setup.family.micro_batch(setup, loader.batch(batch_index), options, run.weights, run.autocast,
                                           (losses, correct, counted), batch_seed(options.seed, item_epoch, item_index))
    if world > 1:  # average gradients over ranks: the same as one process accumulating them all
        if not run.sharded:  # (FSDP2 reduce-scatters them itself)
            for param in setup.drafter.trainable_parameters():
                all_reduce_sum(param.grad).div_(world)
        for tally in (losses, correct, counted):
            all_reduce_sum(tally)
        losses /= world
        tokens = int(all_reduce_sum(torch.tensor(tokens)))
    grad_norm = torch.nn.utils.clip_grad_norm_(setup.drafter.trainable_parameters(), options.clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return tokens, (losses.cpu(), correct.cpu(), counted.cpu()), grad_norm


def _record(run: _Run, tokens: int, tallies: tuple, grad_norm: torch.Tensor, tokens_per_s: float) -> list[float]:
    """The step's metrics line (``run.record``) from its tallies → each tally's accuracy."""
    losses, correct, counted = tallies
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # sharded: a DTensor
    run.report.tokens += tokens
    if run.counted is not None:
        run.counted += float(counted.sum())
    accuracy = (correct / counted.clamp(min=1)).tolist()
    run.record = {"step": run.step, "epoch": run.epoch, "loss": float((losses * torch.tensor(run.weights)).sum()),
                  "step_loss": losses.tolist(), "accuracy": accuracy, "lr": run.scheduler.get_last_lr()[0],
                  "grad_norm": float(grad_norm), "tokens": tokens, "tokens_per_s": tokens_per_s}
    return accuracy


def _check_learning(run: _Run) -> None:
    """Refuse a run whose steps found no position to learn from once they have seen every training batch: its loss
    counted no token and never will, so its drafter would stay as initialised behind a loss of 0 (refused before the
    step's checkpoint; RUN_DIR keeps what the run wrote before). A run that ends before it has seen them all, having
    counted none, ends with a warning saying so."""
    batches = len(run.setup.source.batches)
    seen = min(run.step * run.per_step, batches)
    if run.counted != 0 or (seen < batches and run.step < run.total_steps):  # None: not counted before this segment
        return
    options = run.options
    role = "data" if trains_online(options.online, options.features, options.data) else "features"
    what = (f"{run.step} training step{'s' if run.step > 1 else ''} ({seen} of the {batches} training batches of "
            f"--{role} {getattr(options, role)}) found no position to learn from — the loss counted no token, so the "
            f"drafter {{}} as initialised: {run.setup.family.nothing_learned(options)}")
    if seen == batches:
        raise EyasError(f"{run.out}: {what.format('would stay')}; no final drafter was written")
    if run.lead:
        print(f"warning: {what.format('stays')} (the batches not seen may hold some)", flush=True)


def _stream_ended(run: _Run, ended: Exception, segment_seconds: float) -> str:
    """A stream's producer is gone mid-step: the finished steps checkpointed (unless the last one was) → the line that
    ends the run."""
    latest = latest_checkpoint(run.out)
    if run.step and (latest is None or checkpoint_state(latest)["step"] != run.step):
        _save_checkpoint(run, segment_seconds)
        latest = latest_checkpoint(run.out)
    kept = f"checkpointed at step {checkpoint_state(latest)['step']}" if latest is not None else "has no checkpoint yet"
    return f"{ended}; {run.out} {kept}: rerun the command with --resume to continue it"


def _log_and_checkpoint(run: _Run, stopping: bool, segment_seconds: float) -> None:
    """The step's evaluation (at a checkpoint), its metrics line, and the checkpoint: every --checkpoint-every steps,
    at the last step, or when stopping."""
    options = run.options
    checkpoint = run.step % options.checkpoint_every == 0 or run.step == run.total_steps or stopping
    if checkpoint and not stopping and run.evaluates:
        run.record["eval"] = run.evaluation()
    if run.lead:
        run.metrics.write(run.record)  # before the checkpoint: a resume drops lines newer than its checkpoint
    if not checkpoint:
        return
    _save_checkpoint(run, segment_seconds)


def _save_checkpoint(run: _Run, segment_seconds: float) -> None:
    """A checkpoint of the run after its last step: weights, optimizer, data position and the totals a resume counts on."""
    options = run.options
    totals = {"tokens": run.report.tokens, "seconds": run.earlier_seconds + segment_seconds,
              "initial_eval": run.report.initial_eval, "counted": run.counted}  # what a resume must not count from zero
    drafter = run.setup.drafter
    save_checkpoint(run.out, run.step, drafter, run.optimizer, run.scheduler, {"epoch": run.epoch, "index": run.index + 1},
                    {"drafter_config": drafter.config.to_dict(), "record": run.record, **totals}, options.keep,
                    write=run.lead)
    barrier()


def _finish(run: _Run) -> TrainReport:
    """The final weights, manifest and report.json (rank 0); a run a stop request ended keeps its checkpoint only."""
    report = run.report
    if report.stopped_by:  # checkpointed, not finished: no final weights, no report.json; --resume continues
        if run.lead:
            run.metrics.close()
        barrier()
        return report
    report.final_eval = run.record.get("eval", {}) if run.step and run.lead else {}
    final_state = full_model_state(run.setup.drafter)  # every rank: a sharded drafter is gathered here
    if run.lead:
        run.metrics.close()
        finish_run_dir(run.out, run.setup.drafter, final_state, asdict(report), run.options, run.setup.inputs)
    barrier()
    return report

