"""DFlash: a block drafter — a few Qwen3 layers over the target's tapped states that propose a whole block of tokens in
one forward (the anchor token followed by block-size − 1 mask slots), reading the target's own embedding and lm_head;
chains in eyas' engine and in vLLM (its ``dflash`` method).

Its parts: :mod:`.config` (the drafter's shape and layer-id rules, no torch), :mod:`.model` (the module, the block
mask, the loss, greedy proposals), :mod:`.objective` (a training step and the holdout's simulated τ), :mod:`.export`
(the directory vLLM loads, written, checked and read back), :mod:`.card` (its model card), :mod:`.runner` (the engine's
block drafter runner) and :mod:`.options` (its ``eyas train`` options).
"""

from __future__ import annotations

from pathlib import Path

from eyas.errors import EyasError
from eyas.families import BuildInputs, Built, Family, register
from eyas.families.dflash.options import DFlashOptions


class DFlash(Family):
    name = "dflash"
    summary = "a block drafter: one forward proposes block-size − 1 tokens; vLLM's dflash method"
    options = DFlashOptions
    formats = {"dflash": "vLLM's dflash method"}
    shardable = False

    def validate(self, options, target_config) -> None:
        from eyas.target.layout import text_config

        vocab = int(text_config(target_config).vocab_size)
        if options.mask_token_id is not None and options.mask_token_id >= vocab:  # (≥ 0: its range)
            raise EyasError(f"--mask-token-id {options.mask_token_id} is outside the target's vocabulary (0 … "
                            f"{vocab - 1}): give an id below {vocab}, e.g. --mask-token-id {vocab - 1}, or leave it out "
                            "(the vocabulary's last id)")

    def training_bytes(self, options, target_config) -> int | None:
        from eyas.families.dflash.config import least_state_bytes

        return least_state_bytes(target_config, options.layer_ids, options.draft_layers)

    def fitting(self, options, target_config, free: int) -> str:
        from eyas.families.dflash.config import least_state_bytes

        per_layer = least_state_bytes(target_config, options.layer_ids, 2) - least_state_bytes(
            target_config, options.layer_ids, 1)
        layers = (free - least_state_bytes(target_config, options.layer_ids, 1)) // per_layer + 1
        if layers < 1:
            return "even one draft layer does not fit: train on a device with more memory"
        return f"give --draft-layers {layers} or fewer"

    def check_samples(self, options, longest: int) -> None:
        fits = longest - 1  # a block's anchor a ≥ 1 (it predicts a + 1 on), the block inside the sample: a + B ≤ length
        if options.block_size <= fits:
            return
        raise EyasError(f"--block-size {options.block_size}: the longest training sample holds {longest} tokens, and "
                        "a block must lie inside a sample after its first token, so no block has a position to learn "
                        "from (the loss would stay 0): " + (f"give --block-size {fits} or less" if fits >= 2 else
                                                           "give longer samples (a block of 2 takes 3 tokens)"))

    def nothing_learned(self, options) -> str:
        return (f"lower --block-size (now {options.block_size}): a block is learned from only where its anchor's next "
                "token is trained and the whole block lies inside the sample")

    def build(self, inputs: BuildInputs) -> Built:
        import torch

        from eyas.families.dflash.config import dflash_config_from_target
        from eyas.families.dflash.model import DFlashDrafter

        options = inputs.options
        self.validate(options, inputs.config)
        config = dflash_config_from_target(inputs.config, inputs.layer_ids, options.block_size, options.draft_layers,
                                           options.mask_token_id)
        torch.manual_seed(options.seed)
        # the target's embedding and lm_head are the block drafter's own input and output
        return Built(DFlashDrafter(config).to(inputs.device), None, inputs.embed.to(inputs.device, inputs.teacher_dtype))

    def tally_weights(self, options, drafter) -> list[float]:
        return [1.0] * (drafter.config.block_size - 1)  # each block slot's share of the loss (already weighted)

    def micro_batch(self, setup, batch, options, weights, autocast, tallies, seed) -> int:
        from eyas.families.dflash.objective import block_micro_batch

        return block_micro_batch(setup.drafter, batch, setup.head, setup.embed, options, autocast, tallies, seed)

    def evaluate(self, setup, options, weights, autocast) -> dict:
        from eyas.families.dflash.objective import evaluate_blocks

        result = evaluate_blocks(setup.drafter, setup.holdout, setup.head, setup.embed, options, options.eval_batches,
                                 autocast)
        result["tau_meaning"] = f"a chain of {setup.drafter.config.block_size - 1} drafts at every evaluated block"
        return result

    def exported(self, config: dict) -> bool:
        from eyas.families.dflash.config import ARCHITECTURE

        return ARCHITECTURE in (config.get("architectures") or [])

    def export(self, recorded, weights, fmt, dtype, train_options, report, target, out):
        from eyas.export.files import TORCH_DTYPES
        from eyas.families.dflash.card import dflash_card
        from eyas.families.dflash.config import DFlashConfig
        from eyas.families.dflash.export import dflash_config_json

        config = dflash_config_json(DFlashConfig.from_dict(recorded), dtype)
        tensors = {name: t.to(TORCH_DTYPES[dtype]).contiguous() for name, t in weights.items()}
        return config, tensors, dflash_card(config, train_options, report, target, Path(out))

    def check(self, directory, config, target, result) -> None:
        from eyas.export.files import integrity_problems
        from eyas.families.dflash.export import dflash_problems

        # the block drafter's own contract (vLLM's dflash method)
        result.errors.extend(integrity_problems(directory) or dflash_problems(directory, config, target))

    def runner(self, draft_dir, layout, capacity, modes):
        from eyas.engine.modes import drafter_spare
        from eyas.families.dflash.export import load_dflash_dir
        from eyas.families.dflash.runner import BlockDraftRunner, check_block_modes

        weight = layout.embed.weight  # a block drafter drafts with the target's embedding and lm_head
        drafter = load_dflash_dir(draft_dir, weight.dtype).to(weight.device)
        block = drafter.config.block_size
        check_block_modes(modes, block, str(draft_dir))
        return BlockDraftRunner(drafter, weight, layout.lm_head, capacity + max(block, drafter_spare(modes)))

    def default_modes(self, config: dict) -> list | None:
        from eyas.speculation import Chain

        block = int(config.get("block_size", 0))  # its whole block as one chain: a block drafter drafts no trees
        return [Chain(block - 1)] if block else None

    def vllm_chains(self, config: dict, modes: list) -> tuple[list[tuple[str, int, str | None]], list[str]]:
        block = int(config.get("block_size", 0))  # one forward proposes block − 1 tokens: the block fixes the round
        return [(f"dflash:{block - 1}", block - 1, "dflash")], [
            f"a DFlash drafter (block {block}): vLLM's dflash method, {block - 1} proposals a round; --mode applies to "
            "EAGLE-3 drafters"]


DFLASH = register(DFlash())
