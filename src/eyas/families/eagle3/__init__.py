"""EAGLE-3 (Li et al. 2025): one Llama-style layer over three of the target's hidden states and the next token's
embedding, trained with training-time test, drafting one token a pass — chains and trees in eyas' engine, chains in
vLLM, trees in SGLang.

Its parts: :mod:`.config` and :mod:`.model` (the drafter's exact layout, DESIGN "Conventions"), :mod:`.ttt` and
:mod:`.loss` (the training forward and loss: training equals inference), :mod:`.objective` (a training step),
:mod:`.evaluate` (the holdout's simulated τ), :mod:`.contract`, :mod:`.export`, :mod:`.speculators`, :mod:`.check`
and :mod:`.load` (the format SGLang and vLLM load, written, checked and read back), :mod:`.flops` and :mod:`.memory`
(what a training step costs), and :mod:`.runner`, the drafter in eyas' engine over its KV cache.
"""

from __future__ import annotations

from eyas.families import BuildInputs, Built, Family, register
from eyas.families.eagle3.options import Eagle3Options


class Eagle3(Family):
    name = "eagle3"
    summary = "one layer, one token a pass, training-time test"
    options = Eagle3Options
    formats = {"eagle3": "the format SGLang and vLLM both load", "speculators": "vLLM's own EAGLE-3 format"}
    shardable = True

    def validate(self, options, target_config) -> None:
        from eyas.families.eagle3.config import check_width

        check_width(target_config, options.hidden_size)

    def training_bytes(self, options, target_config) -> int | None:
        from eyas.families.eagle3.memory import least_state_bytes

        return least_state_bytes(target_config, options.layer_ids, options.hidden_size)

    def fitting(self, options, target_config, free: int) -> str:
        from eyas.families.eagle3.memory import fitting_width

        return fitting_width(target_config, options, free)

    def check_samples(self, options, longest: int) -> None:
        from eyas.errors import EyasError

        reach = longest - 2  # TTT step k (from 0) at position i predicts token i + 2 + k: later steps predict nothing
        if options.ttt_steps <= reach:
            return
        if reach < 1:
            raise EyasError(f"--ttt-steps {options.ttt_steps}: the longest training sample holds {longest} tokens, too "
                            "few for any TTT step to have a token to predict (it takes 3): give longer samples")
        raise EyasError(f"--ttt-steps {options.ttt_steps}: the longest training sample holds {longest} tokens, so only "
                        f"the first {reach} TTT steps have a token to predict (the others would learn nothing): give "
                        f"--ttt-steps {reach} or less")

    def nothing_learned(self, options) -> str:
        return ("check the training data: it needs trained (assistant) tokens past each sample's second token whose "
                "target's top choice is in the draft vocabulary")

    def build(self, inputs: BuildInputs) -> Built:
        from eyas.data.vocab import load_vocab
        from eyas.errors import EyasError
        from eyas.families.eagle3.config import drafter_config_from_target
        from eyas.families.eagle3.objective import new_drafter

        self.validate(inputs.options, inputs.config)
        if not inputs.vocab_path.is_file():
            raise EyasError(f"{inputs.vocab_path} is missing: the draft vocabulary comes from eyas prepare's DATA_DIR")
        vocab = load_vocab(inputs.vocab_path)
        draft_ids = vocab.draft_ids.to(inputs.device)
        options = inputs.options
        config = drafter_config_from_target(inputs.config, inputs.layer_ids, len(vocab.d2t), options.hidden_size,
                                            options.fc_norm, options.norm_output)
        drafter = new_drafter(config, vocab.d2t, inputs.head, inputs.embed, draft_ids, options.seed)
        return Built(drafter.to(inputs.device), draft_ids)

    def tally_weights(self, options, drafter) -> list[float]:
        return [options.step_decay**k for k in range(options.ttt_steps)]  # TTT step k's loss weighs decay^k

    def micro_batch(self, setup, batch, options, weights, autocast, tallies, seed) -> int:
        from eyas.families.eagle3.objective import micro_batch

        return micro_batch(setup.drafter, batch, setup.head, setup.draft_ids, options, weights, autocast, tallies)

    def evaluate(self, setup, options, weights, autocast) -> dict:
        from eyas.families.eagle3.evaluate import evaluate

        result = evaluate(setup.drafter, setup.holdout, setup.head, setup.draft_ids, options.ttt_steps, weights,
                          options.eval_batches, autocast, options.eval_temperatures)
        if setup.prediction is not None:  # --predict: the τ eyas bench will measure on its own prompts
            from eyas.families.eagle3.predict import predict

            result["predicted"] = predict(setup.drafter, setup.prediction, setup.head, setup.draft_ids, autocast)
            result["predicted_by"] = setup.prediction.decoder
        return result

    def shard(self, drafter) -> None:
        from eyas.families.eagle3.objective import shard

        shard(drafter)

    def exported(self, config: dict) -> bool:
        return True  # the default family: anything no other family claims is read as EAGLE-3 (and checked as such)

    def fit_config(self, config: dict) -> dict:
        from eyas.errors import EyasError
        from eyas.families.eagle3.contract import flat_config, kind_problems

        flat = flat_config(config)  # vLLM's speculators format nests the layer's config
        problems = kind_problems(flat, missing=False)  # what is missing, the loader names; what is wrong, here
        if problems:
            raise EyasError("; ".join(problems))
        return flat

    def export(self, recorded, weights, fmt, dtype, train_options, report, target, out):
        from eyas.export.card import serve_target
        from eyas.families.eagle3.card import model_card
        from eyas.families.eagle3.config import DrafterConfig
        from eyas.families.eagle3.export import draft_config, draft_tensors
        from eyas.families.eagle3.speculators import speculators_config

        config = draft_config(DrafterConfig.from_dict(recorded), target["model_type"], target["num_layers"], dtype)
        tensors = draft_tensors(weights, config, dtype)
        card = model_card(config, train_options, report, target, out)
        if fmt == "speculators":  # the verifier as vLLM loads it (a placeholder would not load: then the spec, as recorded)
            engine_target, _ = serve_target(target)
            config = speculators_config(config, train_options["target"] if engine_target.startswith("<") else engine_target)
        return config, tensors, card

    def check(self, directory, config, target, result) -> None:
        from eyas.families.eagle3.check import check_eagle3

        check_eagle3(directory, config, target, result)

    def runner(self, draft_dir, layout, capacity, modes):
        from eyas.families.eagle3.runner import DraftRunner
        from eyas.engine.modes import check_modes_fit, drafter_spare
        from eyas.families.eagle3.load import load_drafter

        weight = layout.embed.weight
        drafter = load_drafter(draft_dir, weight, layout.num_layers, device=weight.device, dtype=weight.dtype)
        check_modes_fit(modes, drafter.config.draft_vocab_size, str(draft_dir))
        return DraftRunner(drafter, capacity + drafter_spare(modes))

    def vllm_chains(self, config, modes):
        chains = [(mode.label(), mode.draft_length, None) for mode in modes if mode.mode == "chain"]
        notes = [f"{mode.label()}: measured in eyas' engine only (eyas bench drives vLLM's EAGLE-3 with chains)"
                 for mode in modes if mode.mode != "chain"]
        return chains, notes


EAGLE3 = register(Eagle3())
