"""The options of ``eyas train``: each field's default and help, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.options import SEED, Options, above, at_least, each, force_option, one_of, option, remote_code, within


@dataclass
class TrainOptions(Options):
    """Train a drafter — EAGLE-3 with training-time test, or a DFlash block drafter — from FEATURES_DIR or online from
    DATA_DIR (one capture serves both families)."""

    target: str = option(help="the target the drafter serves")
    out: Path = option(help="RUN_DIR: checkpoints, metrics.jsonl, tensorboard/, final/")
    features: Path | None = option(None, "FEATURES_DIR from eyas capture (offline training)")
    data: Path | None = option(None, "DATA_DIR from eyas prepare (with --online)")
    online: bool = option(False, "run the target in this process: nothing is written to disk "
                          "(the default when --data is given without --features)")
    resume: bool = option(False, "continue RUN_DIR from its latest checkpoint (only the step limit, checkpoint cadence, "
                          "--attention, --fsdp and --trust-remote-code may differ from the run's, and the number of "
                          "processes when --grad-accum × processes stays what it was)")
    force: bool = force_option()
    drafter: str = option("eagle3", "the drafter family: eagle3 (one layer, one token a pass, training-time test) or "
                          "dflash (a block drafter: one forward proposes block-size − 1 tokens; vLLM's dflash method)",
                          check=one_of("eagle3", "dflash"))
    ttt_steps: int = option(7, "eagle3: training-time-test steps K", check=at_least(1))
    step_decay: float = option(0.8, "eagle3: weight of step k's loss is decay^k", check=within(0, 1, low_open=True))
    block_size: int = option(16, "dflash: tokens a block holds, its anchor included (it proposes block-size − 1); the "
                             "published drafters' 16", check=at_least(2))
    draft_layers: int = option(5, "dflash: decoder layers (the published drafters' 5)", check=at_least(1))
    block_coverage: float = option(1.0, "dflash: block rows per token of a batch row (blocks per row = coverage × "
                                   "width / block size, anchored at random trained places; above 1 it runs as "
                                   "passes of width / block size blocks, each its own forward and backward)",
                                   check=above(0))
    slot_decay: float | None = option(7.0, "dflash: slot k's loss weight is exp(−(k − 1)/γ), γ this (the published 7 "
                                      "for blocks of 16)", check=above(0))
    mask_token_id: int | None = option(None, "dflash: the token id of a block's mask slots (default: the vocabulary's "
                                       "last id)", check=at_least(0))
    # benchmarks/LOG.md "Learning rate": a sweep from 1e-4 to 1.5e-2 peaked at 3e-3 (2e-3 – 5e-3 within 3 %)
    lr: float = option(3e-3, "peak learning rate (AdamW); the default is the best of the project's sweep on the demo "
                       "target (1e-4 … 1.5e-2, broad optimum 2e-3 – 5e-3; benchmarks/LOG.md)", check=above(0))
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas", check=each(within(0, 1, high_open=True)))
    weight_decay: float = option(0.0, "AdamW weight decay", check=at_least(0))
    warmup_ratio: float = option(0.015, "share of steps with linear warm-up (then cosine)", check=within(0, 1))
    clip: float = option(0.5, "gradient-norm clip", check=above(0))
    epochs: float = option(1.0, "passes over the training split", check=above(0))
    max_steps: int | None = option(None, "stop after this many optimizer steps", check=at_least(1))
    token_budget: int = option(8192, "tokens per micro-batch, padding included", check=at_least(1))
    grad_accum: int = option(1, "micro-batches per optimizer step", check=at_least(1))
    attention: str = option("auto", "how TTT steps after the first attend (the same result up to rounding; only speed "
                            "and memory differ): concat = one fused attention over real and own keys under a mask, "
                            "split = a causal flash kernel over real keys merged with the own keys by log-sum-exp, "
                            "scores = written out; auto = split on a GPU, scores elsewhere",
                            check=one_of("auto", "concat", "split", "scores"))
    checkpoint_every: int = option(500, "optimizer steps between checkpoints (and holdout evaluations)", check=at_least(1))
    eval_batches: int | None = option(50, "holdout batches per evaluation (all if not given)", check=at_least(1))
    eval_temperatures: tuple[float, ...] = option((1.0,), "EAGLE-3: each holdout evaluation also simulates τ at these "
                                                  "sampling temperatures, comma-separated, for chains whose drafts are "
                                                  "drawn from the drafter (eyas generate/bench at --temperature T)",
                                                  check=each(above(0)))
    keep: int = option(3, "checkpoints kept (the oldest are deleted)", check=at_least(1))
    seed: int = option(0, "seed of the drafter's initialisation and the batch order", check=SEED)
    fsdp: bool = option(False, "under torchrun: shard the drafter over ranks with FSDP2 (for drafters of very large targets)")
    hidden_size: int | None = option(None, "drafter width (default: the target's)", check=at_least(1))
    layer_ids: tuple[int, ...] | None = option(None, "online only: eyas layer ids (default 2, N//2, N-3, for either "
                                               "family: the taps one capture stores)",
                                               check=each(at_least(0)))
    verify: bool = option(True, "before the first step, check FEATURES_DIR's shards against the SHA-256 its manifest "
                          "records and that --target is the target the store was captured from; --no-verify skips both "
                          "and says so (shard sizes and the target's sizes are still checked)", flag="--verify/--no-verify")
    trust_remote_code: bool = remote_code()


# What `--resume` may change: when the run ends (the step limit; the learning-rate schedule then stretches to the new
# total), how often it checkpoints and how many it keeps, how it is distributed (the number of processes too, with
# --grad-accum keeping a step's micro-batches: eyas.train.resume) and what code it may run, how the
# TTT steps attend (the same result), and where RUN_DIR now lies. Any other change (lr, TTT steps, batching, seed,
# eval size, drafter shape, layer ids, the target) would make RUN_DIR describe a run that never happened: it is refused.
# The data (--features / --data / --online) is compared by content, not by path: a moved DATA_DIR or FEATURES_DIR
# resumes.
RESUMABLE = frozenset({"out", "max_steps", "epochs", "checkpoint_every", "keep", "fsdp", "trust_remote_code", "attention"})
DATA_OPTIONS = ("features", "data", "online")


def trains_online(online: bool, features, data) -> bool:
    """Whether a run trains online (the target in the loop): asked for, or --data given without --features."""
    return bool(online or (features is None and data is not None))
