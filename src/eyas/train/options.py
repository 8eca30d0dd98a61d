"""The options of ``eyas train``: each field's default and help, once. Those every family shares are here; each drafter
family adds its own (:class:`eyas.families.Family`'s ``options``), so :class:`TrainOptions` is built from both: one
flat set of flags, one train_options.json."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from eyas import families
from eyas.errors import EyasError
from eyas.options import (
    SEED,
    Options,
    above,
    at_least,
    compile_layers_option,
    copied_field,
    each,
    force_option,
    one_of,
    option,
    remote_code,
    vllm_args_option,
    vllm_python_option,
    within,
)


@dataclass
class CommonTrainOptions(Options):
    """Train a drafter of any family (--drafter) from FEATURES_DIR or online from DATA_DIR (one capture serves every
    family)."""

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
    drafter: str = option(families.DEFAULT, "the drafter family: " + "; ".join(
        f"{family.name} ({family.summary})" for family in families.families()), check=one_of(*families.names()))
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
    checkpoint_every: int = option(500, "optimizer steps between checkpoints (and holdout evaluations)", check=at_least(1))
    eval_batches: int | None = option(50, "holdout batches per evaluation (all if not given)", check=at_least(1))
    keep: int = option(3, "checkpoints kept (the oldest are deleted)", check=at_least(1))
    seed: int = option(0, "seed of the drafter's initialisation and the batch order", check=SEED)
    fsdp: bool = option(False, "under torchrun: shard the drafter over ranks with FSDP2 (for drafters of very large targets)")
    stream: bool = option(False, "capture while training, with no feature store: a producer (--stream-producer) runs the "
                          "target over --data DATA_DIR in the order the trainer takes the batches and hands their states "
                          "over through a bounded buffer; only checkpoints are written. The weights are an offline "
                          "run's from a store captured in the same batches at --stream-dtype")
    stream_dtype: str = option("bf16", "--stream: the precision the states travel in, as capture's --dtype (bf16, fp16, "
                               "fp32, or fp8: e4m3 with a per-token scale)", check=one_of("bf16", "fp16", "fp32", "fp8"))
    stream_depth: int = option(4, "--stream: training batches the producer may capture ahead of the trainer (the "
                               "buffer; a full one holds the producer back)", check=at_least(1))
    producer_device: str | None = option(None, "--stream: where the producer runs the target with HF (default: the "
                                         "trainer's device; e.g. cuda:1, or cuda to spread a large target over every "
                                         "GPU)")
    stream_producer: str = option("auto", "--stream: how the producer on this host runs: process (a process of "
                                  "its own: a failure or kill -9 of either side leaves the other to end cleanly), "
                                  "thread (HF, a thread of the trainer's process capturing on a CUDA stream of its own: "
                                  "no copies between processes, and one GPU may run the capture's kernels beside the "
                                  "training's), or auto: a thread where it runs the target with HF on the trainer's own "
                                  "GPU (the faster there), a process elsewhere",
                                  check=one_of("auto", "process", "thread"))
    stream_listen: str | None = option(None, "--stream: wait at HOST:PORT for a producer on another host (it runs "
                                       "eyas produce --trainer HOST:PORT) instead of starting one here; gloo over TCP")
    stream_engine: str = option("hf", "--stream: what runs the target: hf (transformers, in the producer) or vllm "
                                "(eyas' vLLM capture worker, asked for one batch at a time)", check=one_of("hf", "vllm"))
    vllm_python: str | None = vllm_python_option()
    vllm_args: list[str] = vllm_args_option("--stream-engine vllm")
    compile_layers: bool = compile_layers_option()
    layer_ids: tuple[int, ...] | None = option(None, "online only: eyas layer ids (default 2, N//2, N-3, for either "
                                               "family: the taps one capture stores)",
                                               check=each(at_least(0)))
    verify: bool = option(True, "before the first step, check FEATURES_DIR's shards against the SHA-256 its manifest "
                          "records and that --target is the target the store was captured from; --no-verify skips both "
                          "and says so (shard sizes and the target's sizes are still checked)", flag="--verify/--no-verify")
    trust_remote_code: bool = remote_code()


# The options only --stream reads (a run without it would ignore them).
STREAM_ONLY = ("stream_dtype", "stream_depth", "producer_device", "stream_producer", "stream_listen", "stream_engine",
               "vllm_python", "vllm_args")


def _checked(options) -> None:
    """Each option within its range (:class:`eyas.options.Options`), then none that only other families than
    --drafter's read given a value of its own (:func:`eyas.families.unread_refusal`), nor a stream's without --stream:
    it would be ignored."""
    Options.__post_init__(options)
    from eyas.options import field_flag

    refusal = families.unread_refusal(options.drafter, vars(options), lambda f: field_flag(f).split("/")[0],
                                      lambda name: f"--drafter {name}")
    if refusal:
        raise EyasError(refusal)
    if getattr(options, "predict", ()) and (options.stream or not trains_online(options.online, options.features,
                                                                              options.data)):
        raise EyasError("--predict answers bench's prompts with the target and captures their states in this process: "
                        "it needs --online (--data DATA_DIR without --features, and no --stream)")
    if not options.stream:
        fields = {f.name: f for f in dataclasses.fields(options)}
        given = [field_flag(fields[name]).split("/")[0] for name in STREAM_ONLY
                 if getattr(options, name) != _default(fields[name])]
        if given:
            raise EyasError(f"{', '.join(given)} {'configures' if len(given) == 1 else 'configure'} a streamed run: add "
                            "--stream, or leave {} out".format("it" if len(given) == 1 else "them"))
        if not options.compile_layers and not trains_online(options.online, options.features, options.data):
            raise EyasError("--no-compile-layers configures the capture of a --stream or --online run; a run from "
                            "--features FEATURES_DIR captures nothing: leave it out")


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# The shared options first (the flags' order in --help), then every family's.
TrainOptions = dataclasses.make_dataclass(
    "TrainOptions", [(f.name, kind, copied_field(f)) for f, kind in (
        (f, typing.get_type_hints(CommonTrainOptions)[f.name]) for f in dataclasses.fields(CommonTrainOptions))]
    + families.options_fields(), bases=(Options,),
    namespace={"__doc__": CommonTrainOptions.__doc__, "__module__": __name__, "__post_init__": _checked})


# What `--resume` may change: when the run ends (the step limit; the learning-rate schedule then stretches to the new
# total), how often it checkpoints and how many it keeps, how it is distributed (the number of processes too, with
# --grad-accum keeping a step's micro-batches: eyas.train.resume) and what code it may run, how the
# TTT steps attend (the same result), where and how a stream's producer runs and how far ahead it may capture (the
# same batches), and where RUN_DIR now lies. Any other change (lr, TTT steps, batching, seed,
# eval size, drafter shape, layer ids, the target) would make RUN_DIR describe a run that never happened: it is refused.
# The data (--features / --data / --online) is compared by content, not by path: a moved DATA_DIR or FEATURES_DIR
# resumes.
RESUMABLE = frozenset({"out", "max_steps", "epochs", "checkpoint_every", "keep", "fsdp", "trust_remote_code", "attention",
                       "stream_depth", "producer_device", "stream_producer", "vllm_python", "stream_listen"})
DATA_OPTIONS = ("features", "data", "online")


def trains_online(online: bool, features, data) -> bool:
    """Whether a run trains online (the target in the loop): asked for, or --data given without --features."""
    return bool(online or (features is None and data is not None))

