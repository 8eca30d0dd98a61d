"""The options of ``eyas train``: each field's default and help, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.options import force_option, option, remote_code


@dataclass
class TrainOptions:
    """Train an EAGLE-3 drafter with training-time test, from FEATURES_DIR or online from DATA_DIR."""

    target: str = option(help="the target the drafter serves")
    out: Path = option(help="RUN_DIR: checkpoints, metrics.jsonl, tensorboard/, final/")
    features: Path | None = option(None, "FEATURES_DIR from eyas capture (offline training)")
    data: Path | None = option(None, "DATA_DIR from eyas prepare (with --online)")
    online: bool = option(False, "run the target in this process: nothing is written to disk "
                          "(the default when --data is given without --features)")
    resume: bool = option(False, "continue RUN_DIR from its latest checkpoint (only the step limit, checkpoint cadence, "
                          "--fsdp and --trust-remote-code may differ from the run's)")
    force: bool = force_option()
    ttt_steps: int = option(7, "training-time-test steps K")
    step_decay: float = option(0.8, "weight of step k's loss is decay^k")
    lr: float = option(1e-4, "peak learning rate (AdamW)")
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_ratio: float = option(0.015, "share of steps with linear warm-up (then cosine)")
    clip: float = option(0.5, "gradient-norm clip")
    epochs: float = option(1.0, "passes over the training split")
    max_steps: int | None = option(None, "stop after this many optimizer steps")
    token_budget: int = option(8192, "tokens per micro-batch, padding included")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    checkpoint_every: int = option(500, "optimizer steps between checkpoints (and holdout evaluations)")
    eval_batches: int | None = option(50, "holdout batches per evaluation (all if not given)")
    keep: int = option(3, "checkpoints kept (the oldest are deleted)")
    seed: int = option(0, "seed of the drafter's initialisation and the batch order")
    fsdp: bool = option(False, "under torchrun: shard the drafter over ranks with FSDP2 (for drafters of very large targets)")
    hidden_size: int | None = option(None, "drafter width (default: the target's)")
    layer_ids: tuple[int, ...] | None = option(None, "online only: eyas layer ids (default 2, N//2, N-3)")
    verify: bool = option(True, "before the first step, check FEATURES_DIR's shards against the SHA-256 its manifest "
                          "records and that --target is the target the store was captured from; --no-verify skips both "
                          "and says so (shard sizes and the target's sizes are still checked)", flag="--verify/--no-verify")
    trust_remote_code: bool = remote_code()


# What `--resume` may change: when the run ends (the step limit; the learning-rate schedule then stretches to the new
# total), how often it checkpoints and how many it keeps, how it is distributed and what code it may run, and where
# RUN_DIR now lies. Any other change (lr, TTT steps, batching, seed, eval size, drafter shape, layer ids, the target)
# would make RUN_DIR describe a run that never happened: it is refused. The data (--features / --data / --online) is
# compared by content, not by path: a moved DATA_DIR or FEATURES_DIR resumes.
RESUMABLE = frozenset({"out", "max_steps", "epochs", "checkpoint_every", "keep", "fsdp", "trust_remote_code"})
DATA_OPTIONS = ("features", "data", "online")


def trains_online(online: bool, features, data) -> bool:
    """Whether a run trains online (the target in the loop): asked for, or --data given without --features."""
    return bool(online or (features is None and data is not None))
