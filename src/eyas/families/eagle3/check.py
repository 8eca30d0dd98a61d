"""``eyas check`` of an EAGLE-3 directory: the contract SGLang and vLLM both load (DESIGN "Export contract"), in eyas'
own layout, SpecForge's, the EAGLE reference's or vLLM's speculators format."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eyas.errors import EyasError
from eyas.export.files import edited_since_export, eyas_name, integrity_problems, read_shapes, read_tensors, weight_files
from eyas.export.fit import fit_problems
from eyas.families.eagle3.contract import (ARCHITECTURE, eagle31_switches, expected_shapes, flat_config,
                                           kind_problems, variant_problems)
from eyas.target.layer_ids import sglang_reads

if TYPE_CHECKING:
    from eyas.export.check import CheckResult

_FLOATS = {"BF16", "F16", "F32"}


def check_eagle3(directory: Path, config: dict, target, result: CheckResult) -> None:
    """Add to ``result`` what is wrong with the EAGLE-3 directory ``directory`` (config.json ``config``), and given the
    ``target``'s sizes, what does not fit it."""
    if "speculators_model_type" in config:
        _check_speculators(config, result)
        config = flat_config(config)
    _check_config(config, result)
    if result.errors:
        return
    damaged = integrity_problems(directory)
    result.errors.extend(damaged)
    result.warnings.extend(edited_since_export(directory))
    try:
        files = weight_files(directory)
        shapes = read_shapes(directory, normalise=False)
    except EyasError as err:
        if not damaged:  # a damaged file is reported once
            result.errors.append(str(err))
    else:
        if files[0].suffix == ".bin":
            result.warnings.append(f"{files[0].name} is a pickle: engines load it, but `eyas export` writes safetensors "
                                   "(no code can hide in it)")
        _check_tensors(config, shapes, result)
        _check_values(directory, config, result)
    if target is not None:
        result.errors.extend(f"made for another target: {problem}" for problem in fit_problems(config, target))
    _check_layer_ids(config, result, target.model_type if target else None, target.num_layers if target else None)


def _check_values(directory: Path, config: dict, result: CheckResult) -> None:
    """Every weight finite (NaN or Inf: a diverged training or flipped bits) and d2t mapping into the vocabulary."""
    try:
        tensors = read_tensors(directory)
    except EyasError as err:  # a .bin that is not plain tensors (read_shapes has passed the safetensors headers)
        result.errors.append(str(err))
        return
    for name, tensor in sorted(tensors.items()):
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                result.errors.append(f"tensor {name} holds {bad:,} NaN or Inf values of {tensor.numel():,}: a training "
                                     "that diverged, or a damaged file; export a checkpoint from before it went wrong")
    d2t, vocab = tensors.get("d2t"), config.get("vocab_size")
    if d2t is not None and d2t.dim() == 1 and len(d2t) and not d2t.is_floating_point() and isinstance(vocab, int):
        ids = torch.arange(len(d2t)) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or bool((ids[1:] <= ids[:-1]).any()):
            result.errors.append(f"d2t does not map the draft vocabulary onto distinct ascending target ids in 0..{vocab - 1} "
                                 "(target id = i + d2t[i]): the file is damaged or was written by another convention")


def _check_config(config: dict, result: CheckResult) -> None:
    arch = config.get("architectures") or []
    if ARCHITECTURE not in arch:
        result.errors.append(f"architectures is {arch}; write [\"{ARCHITECTURE}\"] (the only Llama EAGLE-3 name SGLang loads)")
    if config.get("model_type") != "llama":
        result.errors.append(f"model_type is {config.get('model_type')!r}; the Llama EAGLE-3 drafter needs \"llama\"")
    if config.get("num_hidden_layers") != 1:
        result.errors.append(f"num_hidden_layers is {config.get('num_hidden_layers')}; EAGLE-3 drafters that load in both "
                             "engines have exactly 1 (SGLang and vLLM build layers ≥ 1 differently)")
    kinds = kind_problems(config)
    result.errors.extend(kinds)
    if kinds:  # what follows reads those fields
        return
    if "draft_vocab_size" not in config:
        result.errors.append("draft_vocab_size is missing: SGLang reads it unconditionally; write the lm_head's rows")
    if config.get("tie_word_embeddings", False):
        result.errors.append("tie_word_embeddings is true: SGLang would replace the drafter's lm_head with the embedding; "
                             "write false")
    if not (config.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        result.errors.append("eagle_config.use_aux_hidden_state is false: the engines would skip fc and feed no target states")
    result.errors.extend(variant_problems(config))
    if switches := eagle31_switches(config):
        result.warnings.append(f"an EAGLE-3.1 drafter ({', '.join(switches)}): vLLM 0.32 and SGLang 0.5.23 run it; "
                               "engines from before EAGLE-3.1 (vLLM PR #42764) refuse its fc_norm tensors or ignore "
                               "norm_output and compute another network")
    if config.get("norm_before_residual"):
        result.warnings.append("norm_before_residual is true: SGLang ignores it and runs the drafter differently from vLLM")
    if any(isinstance(value, dict) for value in (config.get("rope_parameters") or {}).values()):
        result.errors.append("rope_parameters is nested (one RoPE per layer type): vLLM and SGLang key their RoPE cache on "
                             "its values and fail; write the one flat RoPE the drafter was trained with")


def _check_speculators(config: dict, result: CheckResult) -> None:
    """vLLM's speculators format: its structure, and the norm placement it defaults differently."""
    if config.get("speculators_model_type") != "eagle3":
        result.errors.append(f"speculators_model_type is {config.get('speculators_model_type')!r}; eyas checks eagle3 drafters")
    try:
        methods = config["speculators_config"]["proposal_methods"]
        int(methods[0]["speculative_tokens"])
        str(config["speculators_config"]["verifier"]["name_or_path"])
    except (KeyError, IndexError, TypeError, ValueError):
        result.errors.append("speculators_config needs proposal_methods[0].speculative_tokens and verifier.name_or_path")
    if not isinstance(config.get("transformer_layer_config"), dict):
        result.errors.append("transformer_layer_config (the drafter layer's Llama config) is missing")
    if config.get("norm_before_residual", True):
        result.errors.append("norm_before_residual is not false: vLLM's speculators reader then defaults it to true and "
                             "normalises the residual, unlike SGLang and eyas; write \"norm_before_residual\": false if the "
                             "drafter adds the un-normed hidden")


def _check_tensors(config: dict, header: dict[str, tuple[list[int], str]], result: CheckResult) -> None:
    expected = expected_shapes(config)
    prefixed = sorted(name for name in header if name.startswith("model."))
    if prefixed:
        result.errors.append(f"tensor names start with 'model.' ({prefixed[0]}, …): vLLM prepends 'model.' itself and "
                             "would look for 'model.model.…'; write the names without the prefix")
    renamed = {eyas_name(name): name for name in header}
    for name, shape in expected.items():
        if name not in renamed:
            hint = " (required: the draft vocabulary is smaller than the target's)" if name == "d2t" else ""
            hint = hint or (" (required: the drafter is narrower than the target)" if name == "embed_tokens.weight" else "")
            result.errors.append(f"tensor {name} is missing{hint}")
            continue
        stored_shape, dtype = header[renamed[name]]
        if stored_shape != shape:
            result.errors.append(f"tensor {name} has shape {stored_shape}, the config implies {shape}")
        if name == "d2t" and dtype != "I64":
            result.errors.append(f"d2t is {dtype}; engines read it as int64 offsets (target id = i + d2t[i])")
        if name != "d2t" and dtype not in _FLOATS:
            result.errors.append(f"tensor {name} is {dtype}; weights must be bf16, fp16 or fp32")
    for name in sorted(set(renamed) - set(expected)):
        if name == "t2d":
            result.warnings.append("t2d is present: both engines ignore it (harmless)")
        elif name == "d2t":
            result.errors.append("d2t is present although the draft vocabulary equals the target's: vLLM's loader rejects it")
        elif name == "embed_tokens.weight":
            result.warnings.append("embed_tokens.weight is present although the drafter is as wide as the target: SGLang "
                                   "replaces it by the target's and current vLLM loads it (harmless when it is the target's "
                                   "embedding), but older vLLM builds without an optional draft embedding fail on the name; "
                                   "drop it for a directory that loads everywhere")
        else:
            result.errors.append(f"unexpected tensor {name}: vLLM's loader rejects names it does not know, SGLang skips them")


def _check_layer_ids(config: dict, result: CheckResult, model_type: str | None, layers: int | None) -> None:
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_ids = top or nested
    if vllm_ids is None:
        return  # both engines use their identical defaults
    if sorted(vllm_ids) != list(vllm_ids):
        result.errors.append(f"layer ids {vllm_ids} are not ascending: fc reads the states low → high")
    if nested is None:
        result.warnings.append("layer ids are only at the top level: vLLM reads them, SGLang does not (it uses its defaults)")
        return
    if model_type is None or layers is None:
        if nested[0] == 1:
            result.warnings.append(f"eagle_config layer ids {nested} start at 1: SpecForge's output-of-layer spelling; "
                                   "pass --target to check what each engine captures")
        return
    sglang_ids = list(sglang_reads(nested, model_type, layers))
    if sglang_ids != list(vllm_ids):
        result.errors.append(f"layer ids mean different states in the two engines: vLLM captures {list(vllm_ids)}, "
                             f"SGLang captures {sglang_ids} for a {model_type} target (eyas ids = input of decoder layer L)")
