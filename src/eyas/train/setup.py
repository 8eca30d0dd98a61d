"""What a training run trains with, built once: the data sources, the teacher (the target's lm_head), the draft
vocabulary and the drafter, and what RUN_DIR records of the target and the inputs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.drafter.config import DrafterConfig, drafter_config_from_target
from eyas.drafter.dflash import DFlashDrafter, dflash_config_from_target
from eyas.drafter.model import Eagle3Drafter
from eyas.errors import EyasError
from eyas.train.data import OfflineSource, OnlineSource
from eyas.train.options import TrainOptions, trains_online
from eyas.train.resume import data_input


@dataclass
class TrainingSetup:
    """What :func:`setup_training` builds. ``head``: the target's lm_head rows (the teacher), on the device;
    ``draft_ids``: the draft vocabulary's target ids (None for a block drafter, which predicts the whole vocabulary);
    ``embed``: the target's embedding, for a block drafter (None otherwise); ``target``: the target facts RUN_DIR
    records, with the layer ids; ``inputs``: the input records of RUN_DIR's manifest."""

    drafter: Any
    source: Any
    holdout: Any
    head: torch.Tensor
    draft_ids: torch.Tensor | None
    target: dict
    inputs: list
    embed: torch.Tensor | None = None


def training_autocast(device: torch.device):
    """The context the drafter's forwards run in: bf16 autocast on CUDA (fp32 master weights), plain fp32 elsewhere."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext


def setup_training(options: TrainOptions, device: torch.device, loaded=None, identity: dict | None = None) -> TrainingSetup:
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
    shared = dict(source=source, holdout=holdout, head=head.to(device, teacher_dtype),
                  target={**facts, "layer_ids": list(layer_ids)}, inputs=[data_input(options), target_input(facts)])
    if options.drafter == "dflash":  # the target's embedding and lm_head are the block drafter's own input and output
        drafter_config = dflash_config_from_target(config, layer_ids, options.block_size, options.draft_layers,
                                                   options.mask_token_id)
        if not 0 <= drafter_config.mask_token_id < drafter_config.vocab_size:
            raise EyasError(f"--mask-token-id {drafter_config.mask_token_id} is outside the target's vocabulary "
                            f"(0 … {drafter_config.vocab_size - 1})")
        torch.manual_seed(options.seed)
        return TrainingSetup(**shared, drafter=DFlashDrafter(drafter_config).to(device), draft_ids=None,
                             embed=embed.to(device, teacher_dtype))
    if not vocab_path.is_file():
        raise EyasError(f"{vocab_path} is missing: the draft vocabulary comes from eyas prepare's DATA_DIR")
    vocab = load_vocab(vocab_path)
    draft_ids = vocab.draft_ids.to(device)
    drafter_config = drafter_config_from_target(config, layer_ids, len(vocab.d2t), options.hidden_size)
    drafter = _new_drafter(drafter_config, vocab.d2t, head, embed, draft_ids, options.seed).to(device)
    return TrainingSetup(**shared, drafter=drafter, draft_ids=draft_ids)


def _new_drafter(config: DrafterConfig, d2t, head, embed, draft_ids, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config, d2t=d2t)
    drafter.load_target_embedding(embed)
    if config.hidden_size == config.target_hidden_size:
        # Warm start: the target's own lm_head rows of the draft vocabulary read the same space.
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head[draft_ids.cpu()].float())
    return drafter


def shard(drafter: Eagle3Drafter) -> None:
    """FSDP2 over ranks, one unit per module the TTT forward calls (it calls them directly, not the root)."""
    from torch.distributed.fsdp import fully_shard

    for module in (drafter.embed_tokens, drafter.fc, drafter.midlayer, drafter.norm, drafter.lm_head):
        fully_shard(module)
