"""The EAGLE-3 format SGLang and vLLM both load: a drafter's ``config.json`` and its tensors (DESIGN "Export contract").

Layer ids are written so they mean the same in both engines: omitted when they are the defaults
(2, N//2, N−3), which both engines use; otherwise vLLM's spelling at the top level (vLLM reads it
first, as-is) and SGLang's spelling in ``eagle_config`` (the only place SGLang reads, converted by
its per-family rule).
"""

from __future__ import annotations

import torch

from eyas.families.eagle3.config import DrafterConfig
from eyas.errors import EyasError
from eyas.families.eagle3.contract import ARCHITECTURE, EAGLE31, expected_shapes
from eyas.export.files import TORCH_DTYPES, torch_dtype_name
from eyas.target.layer_ids import is_default_layer_ids, sglang_spelling

def draft_config(config: DrafterConfig, target_model_type: str, target_layers: int, dtype: str) -> dict:
    """The drafter's ``config.json``."""
    if config.norm_before_residual:
        raise EyasError("this drafter adds the normed hidden as its residual (a speculators-format variant): SGLang cannot "
                        "run that; eyas exports only drafters that add the un-normed hidden")
    rope = dict(config.rope_parameters)
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_parameters": rope,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": torch_dtype_name(dtype),
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    for variant in EAGLE31:  # written only when set: a plain EAGLE-3 config stays what older engines read
        if getattr(config, variant):
            out[variant] = True
    ids = tuple(config.layer_ids)
    if not is_default_layer_ids(ids, target_layers):  # a target under 6 layers has none: its ids are always written out
        out["eagle_aux_hidden_state_layer_ids"] = list(ids)  # vLLM: as-is
        spelled = sglang_spelling(ids, target_model_type, target_layers)
        if spelled is None:
            raise EyasError(f"layer ids {list(ids)} cannot be written so that SGLang captures the same states for a "
                            f"{target_model_type} target; train with other ids (e.g. the defaults)")
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(spelled)
        out["num_aux_hidden_states"] = len(ids)
    return out


def draft_tensors(tensors: dict[str, torch.Tensor], config: dict, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors the contract names, cast to ``dtype`` (d2t stays int64); nothing else."""
    wanted = expected_shapes(config)
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise EyasError(f"the checkpoint lacks {missing}; is it an eyas drafter?")
    out = {}
    for name in wanted:
        tensor = tensors[name]
        out[name] = tensor.to(torch.int64) if name == "d2t" else tensor.to(TORCH_DTYPES[dtype])
        if list(out[name].shape) != wanted[name]:
            raise EyasError(f"{name} has shape {list(out[name].shape)}, the config implies {wanted[name]}")
    return {name: out[name].contiguous() for name in sorted(out)}
