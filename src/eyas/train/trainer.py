"""``eyas train``: the drafter, trained offline or online, resumable.

One loop: a batch (from FEATURES_DIR, or captured now by the target) → the family's micro-batch → AdamW (β 0.9/0.95,
clip 0.5, linear warm-up then cosine) → metrics, checkpoints, holdout evaluation. EAGLE-3: the target's teacher
distribution from its final hidden → K TTT steps → Σ_k decay^k · loss_k. DFlash (:mod:`eyas.train.blocks`): random
blocks of each row, every slot against the target's greedy token, in one forward. bf16 autocast with fp32 master
weights on GPU, fp32 on CPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eyas.distributed import all_reduce_sum, barrier, init_distributed, world_size
from eyas.drafter.config import DrafterConfig, drafter_config_from_target
from eyas.drafter.dflash import DFlashDrafter, dflash_config_from_target
from eyas.drafter.loss import step_loss, target_signal
from eyas.drafter.model import Eagle3Drafter
from eyas.drafter.ttt import ttt_steps
from eyas.errors import EyasError
from eyas.out_lock import one_writer
from eyas.outputs import check_space, claim_out, writing
from eyas.progress import progress_bar
from eyas.train.blocks import batch_seed, block_micro_batch, evaluate_blocks
from eyas.train.checkpoint import full_model_state, latest_checkpoint, load_checkpoint, run_bytes, save_checkpoint
from eyas.train.data import OfflineSource, OnlineSource, Prefetcher, batches_forever
from eyas.train.evaluate import evaluate
from eyas.train.options import TrainOptions, trains_online
from eyas.train.resume import data_input, new_record, read_run_record, resume_changes, resumed_record, target_identity
from eyas.train.run_dir import MARKERS as RUN_MARKERS
from eyas.train.run_dir import clear_run_dir, finish_run_dir, start_run_dir


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


@one_writer("train", lambda options, *_, **__: options.out)
def train(options: TrainOptions, loaded=None) -> TrainReport:
    """Run (or resume) training; returns the report, also written to RUN_DIR/report.json. ``loaded``: for --online, the
    target already in memory (see :func:`setup_training`)."""
    torch.manual_seed(options.seed)
    rank, world, device = init_distributed()
    lead = rank == 0  # rank 0 evaluates, logs and writes checkpoints
    autocast = training_autocast(device)
    out = Path(options.out)
    # 1. --out is checked, and a resume judged against the run's record, before the target is loaded or anything is written
    if lead:
        claim_out(out, "train", options.force, RUN_MARKERS)
    latest = latest_checkpoint(out)
    start_over = latest is not None and not options.resume
    if start_over and not options.force:
        raise EyasError(f"{out} already holds a run (checkpoint {latest.name}); pass --resume to continue it, --force "
                        "to start it over, or use another --out")
    if start_over:  # --force: a new run (the old one's files are removed just before it writes its own)
        latest = None
    at = json.loads((latest / "state.json").read_text())["step"] if latest is not None else 0
    recorded = read_run_record(out) if latest is not None else None
    target = target_identity(options)
    changes = resume_changes(recorded, options, at, out, target, world) if recorded is not None else {}
    setup = setup_training(options, device, loaded, target)
    drafter, source, holdout, head, draft_ids = setup["drafter"], setup["source"], setup["holdout"], setup["head"], setup["draft_ids"]
    blocks = options.drafter == "dflash"
    if blocks and options.fsdp:
        raise EyasError("--fsdp shards EAGLE-3 drafters only: train the DFlash drafter without it (it is the size of a "
                        "few target layers)")
    if lead:
        check_space(out, run_bytes(out, drafter, options.keep), options.force, "training (checkpoints, final weights)",
                    ", keep fewer checkpoints with --keep")
    sharded = options.fsdp and world > 1
    if sharded:
        _shard(drafter)
    micro_per_epoch = len(source.batches)
    per_step = options.grad_accum * world  # micro-batches per optimizer step, over all ranks
    total_steps = options.max_steps or max(1, math.ceil(options.epochs * micro_per_epoch / per_step))
    if at > total_steps:
        raise EyasError(f"{out} is at step {at}, past the {total_steps} steps --max-steps/--epochs now give: give at least "
                        f"--max-steps {at}, or train into a new --out")
    run_record = new_record(options, target, world) if recorded is None else \
        resumed_record(recorded, options, at, changes, at < total_steps, target, world)
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=options.lr, betas=options.betas,
                                  weight_decay=options.weight_decay)
    warmup = max(1, round(options.warmup_ratio * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, warmup, total_steps))
    # what one step's tallies hold: each TTT step's loss (EAGLE-3), or each block slot's share of the loss (DFlash)
    tallied = options.ttt_steps if not blocks else drafter.config.block_size - 1
    weights = [options.step_decay**k for k in range(options.ttt_steps)] if not blocks else [1.0] * tallied

    def evaluation() -> dict:
        if blocks:
            return evaluate_blocks(drafter, holdout, head, setup["embed"], options, options.eval_batches, autocast)
        return evaluate(drafter, holdout, head, draft_ids, options.ttt_steps, weights, options.eval_batches, autocast,
                        options.eval_temperatures)

    report = TrainReport()
    step, epoch, index = 0, 0, 0
    record: dict = {}  # the last step's metrics (a resumed run starts from its checkpoint's)
    state: dict = {}
    if start_over and lead:
        clear_run_dir(out)
    if latest is not None:
        state = load_checkpoint(latest, drafter, optimizer, scheduler)
        step, epoch, index = state["step"], state["position"]["epoch"], state["position"]["index"]
        record = state.get("record", {})  # a finished run resumed runs no step: its final record is the checkpoint's
        report.resumed_from = step
    barrier()  # every rank has read the checkpoint before rank 0 may write a new one
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        start_run_dir(out, run_record, drafter.config.to_dict(), setup["target"])
    metrics = _Metrics(out, keep_up_to=step if latest is not None else -1) if lead else None
    if latest is not None:  # 2. the totals of the segments before this one (from the run's log if the checkpoint is older)
        logged = metrics.lines if metrics else []
        report.tokens = state.get("tokens", sum(line.get("tokens", 0) for line in logged))
        report.seconds = state.get("seconds", 0.0)
        report.initial_eval = state.get("initial_eval", next((line["eval"] for line in logged if line["step"] == 0
                                                              and "eval" in line), {}))
    earlier_seconds = report.seconds
    if step == 0 and holdout is not None and (lead or sharded):  # a sharded drafter evaluates on every rank
        report.initial_eval = evaluation()
        if lead:
            metrics.write({"step": 0, "eval": report.initial_eval})

    started, segment_tokens = time.perf_counter(), 0
    drafter.train()
    stream = batches_forever(source, options.seed, epoch, index)
    bar_name = "train" if world == 1 else f"train (rank {rank}/{world})"
    with StopRequests() as stop, progress_bar(bar_name, total=total_steps, unit="step") as bar, \
            contextlib.closing(Prefetcher(source)) as loader:  # shards are read one optimizer step ahead, on a thread
        upcoming = [next(stream) for _ in range(per_step)]
        loader.ahead(i for _, _, i in upcoming[rank::world])
        bar(step)
        while step < total_steps:
            # Tallies stay on the device until the step ends: reading one back per TTT step would make the
            # host wait for the GPU 21 times a batch instead of queueing the next kernels.
            losses = torch.zeros(tallied, device=device)
            correct, counted, tokens = torch.zeros_like(losses), torch.zeros_like(losses), 0
            global_items = upcoming  # every rank walks the same global order
            upcoming = [next(stream) for _ in range(per_step)]
            loader.ahead(i for _, _, i in upcoming[rank::world])
            epoch, index = global_items[-1][0], global_items[-1][1]  # data position after this step
            mine = global_items[rank::world]
            for item_epoch, item_index, batch_index in mine:
                if blocks:
                    tokens += block_micro_batch(drafter, loader.batch(batch_index), head, setup["embed"], options,
                                                autocast, (losses, correct, counted),
                                                batch_seed(options.seed, item_epoch, item_index))
                else:
                    tokens += micro_batch(drafter, loader.batch(batch_index), head, draft_ids, options, weights, autocast,
                                          (losses, correct, counted))
            if world > 1:  # average gradients over ranks: the same as one process accumulating them all
                if not sharded:  # (FSDP2 reduce-scatters them itself)
                    for param in drafter.trainable_parameters():
                        all_reduce_sum(param.grad).div_(world)
                for tally in (losses, correct, counted):
                    all_reduce_sum(tally)
                losses /= world
                tokens = int(all_reduce_sum(torch.tensor(tokens)))
            losses, correct, counted = losses.cpu(), correct.cpu(), counted.cpu()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), options.clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            report.tokens += tokens
            segment_tokens += tokens
            accuracy = (correct / counted.clamp(min=1)).tolist()
            record = {"step": step, "epoch": epoch, "loss": float((losses * torch.tensor(weights)).sum()),
                      "step_loss": losses.tolist(), "accuracy": accuracy, "lr": scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "tokens": tokens,
                      "tokens_per_s": segment_tokens / max(time.perf_counter() - started, 1e-9)}
            stopping = stop.agreed() and step < total_steps  # every rank stops after the same step
            checkpoint = step % options.checkpoint_every == 0 or step == total_steps or stopping
            if checkpoint and not stopping and holdout is not None and (lead or sharded):
                record["eval"] = evaluation()
            if lead:
                metrics.write(record)  # before the checkpoint: a resume drops lines newer than its checkpoint
            if checkpoint:
                totals = {"tokens": report.tokens, "seconds": earlier_seconds + time.perf_counter() - started,
                          "initial_eval": report.initial_eval}  # what a resume must not count from zero
                save_checkpoint(out, step, drafter, optimizer, scheduler, {"epoch": epoch, "index": index + 1},
                                {"drafter_config": drafter.config.to_dict(), "record": record, **totals}, options.keep,
                                write=lead)
                barrier()
            bar(1)
            bar.note(f"loss {record['loss']:.3f} acc₀ {accuracy[0]:.3f} {record['tokens_per_s']:,.0f} tok/s")
            if stopping:
                report.stopped_by, report.exit_code = stop.signal_name, stop.exit_code
                break
    report.steps = step
    report.seconds = earlier_seconds + time.perf_counter() - started
    if report.stopped_by:  # checkpointed, not finished: no final weights, no report.json; --resume continues
        if lead:
            metrics.close()
        barrier()
        return report
    report.final_eval = record.get("eval", {}) if step and lead else {}
    final_state = full_model_state(drafter)  # every rank: a sharded drafter is gathered here
    if lead:
        metrics.close()
        finish_run_dir(out, drafter, final_state, asdict(report), options, setup["inputs"])
    barrier()
    return report


def micro_batch(drafter: Eagle3Drafter, batch, head: torch.Tensor, draft_ids: torch.Tensor, options: TrainOptions,
                weights: list[float], autocast, tallies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
    """Forward (the teacher, K TTT steps) and backward of one micro-batch; adds each step's loss, hits and counted
    positions to ``tallies`` (on the device, not read back); returns the batch's real tokens."""
    losses, correct, counted = tallies
    signal = target_signal(batch.final, head, draft_ids)
    total = 0.0
    with autocast():
        attention = None if options.attention == "auto" else options.attention
        for k, logits in enumerate(ttt_steps(drafter, batch.aux, batch.input_ids, options.ttt_steps, attention)):
            result = step_loss(logits, signal, batch.loss_mask, k)
            total = total + weights[k] * result.loss
            losses[k] += result.loss.detach() / options.grad_accum
            correct[k] += result.correct
            counted[k] += result.count
    (total / options.grad_accum).backward()
    return batch.tokens


class StopRequests:
    """SIGTERM (a scheduler's time limit, ``timeout``, torchrun shutting down) or a first Ctrl-C ends
    training after the current step, with a checkpoint, instead of losing every step since the last
    one; the same command with ``--resume`` continues. A second Ctrl-C interrupts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self.exit_code = 0  # 128 + the signal's number, the shell's convention for a run a signal ended
        self._previous: dict = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._request)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _request(self, number, frame) -> None:
        if self.signal_name is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name, self.exit_code = signal.Signals(number).name, 128 + number
        print(f"\neyas train: {self.signal_name}; stopping after this step with a checkpoint (Ctrl-C again to "
              "interrupt now)", file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True when this rank or any other was asked to stop (ranks may see the signal a step apart)."""
        requested = torch.tensor([1.0 if self.signal_name else 0.0])
        if world_size() > 1:
            all_reduce_sum(requested)
            if self.signal_name is None and requested.item() > 0:
                self.signal_name, self.exit_code = "a stop on another rank", 128 + signal.SIGTERM
        return bool(requested.item() > 0)


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to zero at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def training_autocast(device: torch.device):
    """The context the drafter's forwards run in: bf16 autocast on CUDA (fp32 master weights), plain fp32 elsewhere."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext


def setup_training(options: TrainOptions, device: torch.device, loaded=None, identity: dict | None = None) -> dict:
    """Data sources, teacher (target lm_head rows), draft vocabulary, the drafter, and what RUN_DIR records: the target
    facts (with the layer ids) and the inputs. ``loaded``: online, the target already in memory (an
    :class:`eyas.target.Target` of ``options.target``'s config) instead of loading it. ``identity``: the target's
    :func:`eyas.train.resume.target_identity`, when the caller has it (its weights fingerprint is not read again)."""
    from eyas.data.vocab import VOCAB_FILE, load_vocab
    from eyas.target.facts import target_facts, target_input
    from eyas.target.layer_ids import resolve_layer_ids
    from eyas.target.loading import load_target_config

    dtype = torch.float32  # master weights and batch states; autocast handles bf16 on GPU
    config, target_source = load_target_config(options.target, options.trust_remote_code)
    facts = target_facts(options.target, config, target_source)
    if trains_online(options.online, options.features, options.data):
        if options.data is None:
            raise EyasError("--online trains from DATA_DIR: give --data DATA_DIR")
        from eyas.manifest import verify_stage_dir
        from eyas.target import load_target

        verify_stage_dir(options.data, "prepare")
        target = loaded or load_target(options.target, device=device, trust_remote_code=options.trust_remote_code)
        layer_ids = resolve_layer_ids(options.layer_ids, target.layout.num_layers)
        data_dir = Path(options.data)
        source = OnlineSource(target, data_dir, "train", layer_ids, options.token_budget, device, dtype)
        holdout = OnlineSource(target, data_dir, "holdout", layer_ids, options.token_budget, device, dtype) \
            if (data_dir / "holdout.parquet").is_file() else None
        head = target.layout.lm_head.weight.detach()
        embed = target.layout.embed.weight.detach()
        vocab_path = data_dir / VOCAB_FILE
    else:
        if options.features is None:
            raise EyasError("give --features FEATURES_DIR (offline) or --data DATA_DIR --online")
        from eyas.store.reader import FeatureStore
        from eyas.store.verify import verify_for_training
        from eyas.target.weights import head_and_embedding, weights_sha256

        store = FeatureStore(options.features, "train")
        weights = identity["weights_sha256"] if identity is not None else \
            weights_sha256(options.target, options.trust_remote_code) if options.verify else None
        verify_for_training(options.features, store.manifest, {**facts, "weights_sha256": weights}, options.verify)
        layer_ids = tuple(store.manifest.layer_ids)
        vocab_path = store.vocab_path()
        source = OfflineSource(options.features, "train", options.token_budget, device, dtype)
        holdout = OfflineSource(options.features, "holdout", options.token_budget, device, dtype) \
            if "holdout" in store.manifest.options["splits"] else None
        head, embed = head_and_embedding(options.target, options.trust_remote_code)
    if not source.batches:
        raise EyasError(f"{options.features or options.data} has an empty train split: nothing to train on; capture (or "
                        "prepare) one with the train split")
    if holdout is not None and not holdout.batches:
        holdout = None  # an empty holdout evaluates nothing: no evaluation is reported, not a loss of 0
    # The teacher's full-vocabulary logits are the target's own: bf16 on a GPU (a float32 [V, Ht] copy would be 4.7 GB
    # at Kimi-K2.5's widths and run its matmul at the float32 rate, a third of a training step), float32 on the CPU.
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shared = {"source": source, "holdout": holdout, "head": head.to(device, teacher_dtype),
              "target": {**facts, "layer_ids": list(layer_ids)}, "inputs": [data_input(options), target_input(facts)]}
    if options.drafter == "dflash":  # the target's embedding and lm_head are the block drafter's own input and output
        drafter_config = dflash_config_from_target(config, layer_ids, options.block_size, options.draft_layers,
                                                   options.mask_token_id)
        if not 0 <= drafter_config.mask_token_id < drafter_config.vocab_size:
            raise EyasError(f"--mask-token-id {drafter_config.mask_token_id} is outside the target's vocabulary "
                            f"(0 … {drafter_config.vocab_size - 1})")
        torch.manual_seed(options.seed)
        return {**shared, "drafter": DFlashDrafter(drafter_config).to(device), "draft_ids": None,
                "embed": embed.to(device, teacher_dtype)}
    if not vocab_path.is_file():
        raise EyasError(f"{vocab_path} is missing: the draft vocabulary comes from eyas prepare's DATA_DIR")
    vocab = load_vocab(vocab_path)
    draft_ids = vocab.draft_ids.to(device)
    drafter_config = drafter_config_from_target(config, layer_ids, len(vocab.d2t), options.hidden_size)
    drafter = _new_drafter(drafter_config, vocab.d2t, head, embed, draft_ids, options.seed).to(device)
    return {**shared, "drafter": drafter, "draft_ids": draft_ids}


def _new_drafter(config: DrafterConfig, d2t, head, embed, draft_ids, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config, d2t=d2t)
    drafter.load_target_embedding(embed)
    if config.hidden_size == config.target_hidden_size:
        # Warm start: the target's own lm_head rows of the draft vocabulary read the same space.
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head[draft_ids.cpu()].float())
    return drafter


def _shard(drafter: Eagle3Drafter) -> None:
    """FSDP2 over ranks, one unit per module the TTT forward calls (it calls them directly, not the root)."""
    from torch.distributed.fsdp import fully_shard

    for module in (drafter.embed_tokens, drafter.fc, drafter.midlayer, drafter.norm, drafter.lm_head):
        fully_shard(module)


class _Metrics:
    """metrics.jsonl (one JSON line per step) and TensorBoard scalars."""

    def __init__(self, out: Path, keep_up_to: int):
        self.path = path = out / "metrics.jsonl"
        self.lines: list[dict] = []  # what earlier segments logged, up to the checkpoint this one resumes from
        if path.is_file():  # drop what a killed run logged after its last checkpoint (all of it when it left none)
            self.lines = [record for record in map(json.loads, filter(str.strip, path.read_text(encoding="utf-8").splitlines()))
                          if record["step"] <= keep_up_to]
            path.write_text("".join(json.dumps(record) + "\n" for record in self.lines), encoding="utf-8")
        self.file = open(path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # noqa: BLE001 — TensorBoard is a convenience; metrics.jsonl is the record
            self.board = None

    def write(self, record: dict) -> None:
        with writing(self.path, "the checkpoints written are intact: free space, then the same command with --resume "
                     "continues from the last one"):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is None:
            return
        step = record["step"]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            if key in record:
                self.board.add_scalar(f"train/{key}", record[key], step)
        for k, acc in enumerate(record.get("accuracy", [])):
            self.board.add_scalar(f"train/accuracy_step{k}", acc, step)
        for key in ("loss", "tau", "tau_answer_start"):
            if key in record.get("eval", {}):
                self.board.add_scalar(f"eval/{key}", record["eval"][key], step)
        for temperature, tau in record.get("eval", {}).get("tau_at_temperature", {}).items():
            self.board.add_scalar(f"eval/tau_T{temperature}", tau, step)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()
