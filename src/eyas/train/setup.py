"""What a training run trains with, built once: the data sources, the teacher (the target's lm_head), and the drafter
its family builds (with its draft vocabulary), and what RUN_DIR records of the target and the inputs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas import families
from eyas.errors import EyasError
from eyas.families import BuildInputs, Family
from eyas.train.data import OfflineSource, OnlineSource
from eyas.train.options import TrainOptions, trains_online
from eyas.train.resume import data_input


@dataclass
class TrainingSetup:
    """What :func:`setup_training` builds. ``head``: the target's lm_head rows (the teacher), on the device;
    ``draft_ids``: the draft vocabulary's target ids (None for a drafter predicting the whole vocabulary); ``embed``:
    the target's embedding on the device when the family trains with it (None otherwise); ``target``: the target facts
    RUN_DIR records, with the layer ids; ``inputs``: the input records of RUN_DIR's manifest; ``family``: the drafter's
    (:mod:`eyas.families`), which builds, trains and evaluates it."""

    drafter: Any
    source: Any
    holdout: Any
    head: torch.Tensor
    draft_ids: torch.Tensor | None
    target: dict
    inputs: list
    embed: torch.Tensor | None = None
    family: Family | None = None
    prediction: Any = None  # with --predict: what the family predicts bench's τ on (eyas.train.prediction.PredictionSet)

    def close(self) -> None:
        """Stop what the setup started: a stream's producer (--stream)."""
        stream = getattr(self.source, "stream", None)
        if stream is not None:
            stream.close()


def training_autocast(device: torch.device):
    """The context the drafter's forwards run in: bf16 autocast on CUDA (fp32 master weights), plain fp32 elsewhere."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext


def setup_training(options: TrainOptions, device: torch.device, loaded=None, identity: dict | None = None) -> TrainingSetup:
    """Data sources, teacher (target lm_head rows), draft vocabulary, the drafter, and what RUN_DIR records: the target
    facts (with the layer ids) and the inputs. ``loaded``: online, the target already in memory (an
    :class:`eyas.target.Target` of ``options.target``'s config) instead of loading it. ``identity``: the target's
    :func:`eyas.train.resume.target_identity`, when the caller has it (its weights fingerprint is not read again). The
    facts RUN_DIR records (and export copies into the DRAFT_DIR's manifest) carry the weights' fingerprints, so that
    a store and a drafter can be checked against the target they are handed."""
    from eyas.data.vocab import VOCAB_FILE
    from eyas.target.facts import target_facts, target_input
    from eyas.target.layer_ids import resolve_layer_ids
    from eyas.target.loading import load_target_config

    dtype = torch.float32  # master weights and batch states; autocast handles bf16 on GPU
    prediction = None
    config, target_source = load_target_config(options.target, options.trust_remote_code)
    facts = {**target_facts(options.target, config, target_source), **_weights_identity(options, identity)}
    if options.stream:
        from eyas.train.stream.setup import stream_sources

        source, holdout, layer_ids, vocab_path = stream_sources(options, device, dtype, facts)
        from eyas.target.weights import head_and_embedding

        head, embed = head_and_embedding(options.target, options.trust_remote_code)
    elif trains_online(options.online, options.features, options.data):
        if options.data is None:
            raise EyasError("--online trains from DATA_DIR: give --data DATA_DIR")
        from eyas.data.fits_target import require_data_fits
        from eyas.manifest import verify_stage_dir
        from eyas.target import load_target

        verify_stage_dir(options.data, "prepare")
        require_data_fits(options.data, options.target, options.trust_remote_code)
        target = loaded or load_target(options.target, device=device, trust_remote_code=options.trust_remote_code)
        layer_ids = resolve_layer_ids(options.layer_ids, target.layout.num_layers)
        data_dir = Path(options.data)
        source = OnlineSource(target, data_dir, "train", layer_ids, options.token_budget, device, dtype,
                              compile_layers=options.compile_layers)
        holdout = OnlineSource(target, data_dir, "holdout", layer_ids, options.token_budget, device, dtype,
                               compile_layers=options.compile_layers) \
            if (data_dir / "holdout.parquet").is_file() else None
        head = target.layout.lm_head.weight.detach()
        embed = target.layout.embed.weight.detach()
        vocab_path = data_dir / VOCAB_FILE
        prediction = _prediction(options, target, holdout, layer_ids, device, dtype, facts)
    else:
        if options.features is None:
            raise EyasError("give --features FEATURES_DIR (offline) or --data DATA_DIR --online")
        from eyas.store.reader import FeatureStore
        from eyas.store.verify import verify_for_training
        from eyas.target.weights import head_and_embedding

        store = FeatureStore(options.features, "train")
        verify_for_training(options.features, store.manifest, facts, options.verify)
        layer_ids = tuple(store.manifest.layer_ids)
        vocab_path = store.vocab_path()
        source = OfflineSource(options.features, "train", options.token_budget, device, dtype)
        holdout = OfflineSource(options.features, "holdout", options.token_budget, device, dtype) \
            if "holdout" in store.manifest.options["splits"] else None
        head, embed = head_and_embedding(options.target, options.trust_remote_code)
    if not source.batches:
        raise EyasError(f"{options.features or options.data} has an empty train split: nothing to train on; capture (or "
                        "prepare) one with the train split")
    family = families.named(options.drafter, "--drafter")
    family.check_samples(options, max(source.lengths))  # options no sample has a position to learn from, refused
    if holdout is not None and not holdout.batches:
        holdout = None  # an empty holdout evaluates nothing: no evaluation is reported, not a loss of 0
    # The teacher's full-vocabulary logits are the target's own: bf16 on a GPU (a float32 [V, Ht] copy would be 4.7 GB
    # at Kimi-K2.5's widths and run its matmul at the float32 rate, a third of a training step), float32 on the CPU.
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shared = dict(source=source, holdout=holdout, head=head.to(device, teacher_dtype),
                  target={**facts, "layer_ids": list(layer_ids)}, inputs=[data_input(options), target_input(facts)])
    built = family.build(BuildInputs(config, tuple(layer_ids), options, head, embed, vocab_path, device, teacher_dtype))
    return TrainingSetup(**shared, drafter=built.drafter, draft_ids=built.draft_ids, embed=built.embed, family=family,
                         prediction=prediction)


def _prediction(options, target, holdout, layer_ids, device, dtype, facts: dict):
    """With --predict (EAGLE-3's option), what the evaluations predict bench's τ on
    (:func:`eyas.train.prediction.build_prediction`), built on every rank alike: under torchrun the others would wait
    at the first barrier while rank 0 decoded. A run without a holdout (nothing evaluated) is refused first."""
    if not getattr(options, "predict", ()):
        return None
    from eyas.train.prediction import build_prediction

    if holdout is None or not holdout.batches:
        raise EyasError(f"--predict reports with each holdout evaluation, and {options.data} has no holdout split: "
                        "prepare DATA_DIR with --holdout, or leave --predict out")
    return build_prediction(options, target, Path(options.data), layer_ids, device, dtype, facts)


def _weights_identity(options: TrainOptions, identity: dict | None) -> dict:
    """The target's weight fingerprints (:mod:`eyas.target.fingerprint`): the caller's, else read now unless
    ``--no-verify``."""
    from eyas.target.fingerprint import FINGERPRINTS, weights_fingerprint

    if identity is not None:
        return {key: identity.get(key) for key in FINGERPRINTS}
    if not options.verify:
        return dict.fromkeys(FINGERPRINTS)
    return weights_fingerprint(options.target, options.trust_remote_code)
