"""DSpark: a block backbone that proposes a whole block in one forward, and a Markov head that makes each proposal
depend on the one before it (deepseek-ai/DeepSpec; vLLM's ``dspark`` method); chains in eyas' engine and in vLLM.

Its parts: :mod:`.config` (the drafter's shape, no torch), :mod:`.model` (the module, the loss, drafting from scratch),
:mod:`.objective` (a training step and the holdout's simulated τ), :mod:`.export` (the directory vLLM loads, written,
checked and read back), :mod:`.card` (its model card), :mod:`.runner` (the engine's runner) and :mod:`.options` (its
``eyas train`` options). The backbone is DFlash's (:mod:`eyas.families.dflash.model`), reused as it is.
"""

from __future__ import annotations

from pathlib import Path

from eyas.errors import EyasError
from eyas.families import BuildInputs, Built, Family, register
from eyas.families.dspark.options import DSparkOptions


class DSpark(Family):
    name = "dspark"
    summary = "a block drafter with a Markov head: one forward proposes spark-block tokens; vLLM's dspark method"
    options = DSparkOptions
    formats = {"dspark": "vLLM's dspark method"}
    shardable = False

    def validate(self, options, target_config) -> None:
        from eyas.target.layout import text_config

        vocab = int(text_config(target_config).vocab_size)
        if options.mask_token_id is not None and options.mask_token_id >= vocab:  # (≥ 0: its range)
            raise EyasError(f"--mask-token-id {options.mask_token_id} is outside the target's vocabulary (0 … "
                            f"{vocab - 1}): give an id below {vocab}, e.g. --mask-token-id {vocab - 1}, or leave it out "
                            "(the vocabulary's last id)")

    def training_bytes(self, options, target_config) -> int | None:
        from eyas.families.dspark.config import least_state_bytes

        return least_state_bytes(target_config, options.layer_ids, options.draft_layers, options.markov_rank)

    def fitting(self, options, target_config, free: int) -> str:
        from eyas.families.dspark.config import least_state_bytes

        def needs(layers: int, rank: int) -> int:
            return least_state_bytes(target_config, options.layer_ids, layers, rank)

        per_layer, per_rank = needs(2, 1) - needs(1, 1), needs(1, 2) - needs(1, 1)
        layers = (free - needs(1, options.markov_rank)) // per_layer + 1
        if layers >= 1:
            return f"give --draft-layers {layers} or fewer"
        rank = (free - needs(options.draft_layers, 1)) // per_rank + 1
        if rank >= 1:
            return f"give --markov-rank {rank} or less"
        rank = (free - needs(1, 1)) // per_rank + 1
        if rank >= 1:
            return f"give --draft-layers 1 and --markov-rank {rank} or less"
        return "even one draft layer does not fit: train on a device with more memory"

    def check_samples(self, options, longest: int) -> None:
        fits = longest - 2  # an anchor a ≥ 1, and the token after the block's last slot inside: a + B < length
        if options.spark_block <= fits:
            return
        raise EyasError(f"--spark-block {options.spark_block}: the longest training sample holds {longest} tokens, and "
                        "a block's anchor must follow a first token and every token it proposes lie inside the sample, "
                        "so no block has a position to learn from (the loss would stay 0): "
                        + (f"give --spark-block {fits} or less" if fits >= 1 else
                           "give longer samples (a block of 1 takes 3 tokens)"))

    def nothing_learned(self, options) -> str:
        return (f"lower --spark-block (now {options.spark_block}): a block is learned from only where its anchor's "
                "next token is trained and every token it proposes lies inside the sample")

    def build(self, inputs: BuildInputs) -> Built:
        import torch

        from eyas.families.dspark.config import dspark_config_from_target
        from eyas.families.dspark.model import DSparkDrafter

        options = inputs.options
        self.validate(options, inputs.config)
        config = dspark_config_from_target(inputs.config, inputs.layer_ids, options.spark_block, options.draft_layers,
                                           options.markov_rank, options.mask_token_id, options.confidence_head)
        torch.manual_seed(options.seed)
        # the target's embedding and lm_head are the drafter's own input and output
        return Built(DSparkDrafter(config).to(inputs.device), None, inputs.embed.to(inputs.device, inputs.teacher_dtype))

    def tally_weights(self, options, drafter) -> list[float]:
        return [1.0] * drafter.config.block_size  # each slot's share of the loss (already weighted)

    def micro_batch(self, setup, batch, options, weights, autocast, tallies, seed) -> int:
        from eyas.families.dspark.objective import spark_micro_batch

        return spark_micro_batch(setup.drafter, batch, setup.head, setup.embed, options, autocast, tallies, seed)

    def evaluate(self, setup, options, weights, autocast) -> dict:
        from eyas.families.dspark.objective import evaluate_spark

        result = evaluate_spark(setup.drafter, setup.holdout, setup.head, setup.embed, options, options.eval_batches,
                                autocast)
        block = setup.drafter.config.block_size
        result["tau_meaning"] = (f"a greedy chain of {block} drafts at every evaluated block (drawn at T = 1: "
                                 f"τ {result['tau_drawn']:.2f})")
        return result

    def exported(self, config: dict) -> bool:
        from eyas.families.dspark.config import ARCHITECTURE

        return ARCHITECTURE in (config.get("architectures") or [])

    def export(self, recorded, weights, fmt, dtype, train_options, report, target, out):
        from eyas.export.files import TORCH_DTYPES
        from eyas.families.dspark.card import dspark_card
        from eyas.families.dspark.config import DSparkConfig
        from eyas.families.dspark.export import dspark_config_json

        config = dspark_config_json(DSparkConfig.from_dict(recorded), dtype)
        tensors = {name: t.to(TORCH_DTYPES[dtype]).contiguous() for name, t in weights.items()}
        return config, tensors, dspark_card(config, train_options, report, target, Path(out))

    def check(self, directory, config, target, result) -> None:
        from eyas.export.files import integrity_problems
        from eyas.families.dspark.export import dspark_problems

        result.errors.extend(integrity_problems(directory) or dspark_problems(directory, config, target))

    def runner(self, draft_dir, layout, capacity, modes):
        from eyas.engine.modes import drafter_spare
        from eyas.families.dspark.export import load_dspark_dir
        from eyas.families.dspark.runner import SparkRunner, check_spark_modes

        weight = layout.embed.weight  # the drafter drafts with the target's embedding and lm_head
        drafter = load_dspark_dir(draft_dir, weight.dtype).to(weight.device)
        block = drafter.config.block_size
        check_spark_modes(modes, block, str(draft_dir))
        return SparkRunner(drafter, weight, layout.lm_head, capacity + max(block, drafter_spare(modes)))

    def default_modes(self, config: dict) -> list | None:
        from eyas.speculation import Chain

        block = int(config.get("block_size", 0))  # its whole block as one chain
        return [Chain(block)] if block else None

    def vllm_chains(self, config: dict, modes: list) -> tuple[list[tuple[str, int, str | None]], list[str]]:
        block = int(config.get("block_size", 0))  # one forward proposes the whole block: the block fixes the round
        return [(f"dspark:{block}", block, "dspark")], [
            f"a DSpark drafter (block {block}): vLLM's dspark method, {block} proposals a round; --mode applies to "
            "EAGLE-3 drafters"]


DSPARK = register(DSpark())
