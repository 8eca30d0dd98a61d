"""``eyas export``: RUN_DIR → DRAFT_DIR in the EAGLE-3 format SGLang and vLLM both load.

Layer ids are written so they mean the same in both engines: omitted when they are the defaults
(2, N//2, N−3), which both engines use; otherwise vLLM's spelling at the top level (vLLM reads it
first, as-is) and SGLang's spelling in ``eagle_config`` (the only place SGLang reads, converted by
its per-family rule). The directory is written under a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.drafter.config import DrafterConfig
from eyas.errors import EyasError
from eyas.export.contract import ARCHITECTURE, expected_shapes
from eyas.target.layer_ids import default_layer_ids, sglang_spelling

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
        "torch_dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    ids = tuple(config.layer_ids)
    if len(ids) != 3 or ids != default_layer_ids(target_layers):
        out["eagle_aux_hidden_state_layer_ids"] = list(ids)  # vLLM: as-is
        spelled = sglang_spelling(ids, target_model_type, target_layers)
        if spelled is None:
            raise EyasError(f"layer ids {list(ids)} cannot be written so that SGLang captures the same states for a "
                            f"{target_model_type} target; train with other ids (e.g. the defaults)")
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(spelled)
        out["num_aux_hidden_states"] = len(ids)
    return out


def speculators_config(config: dict, target: str, speculative_tokens: int = 3) -> dict:
    """The same drafter in vLLM's speculators format (``vllm serve DRAFT_DIR`` finds the target itself)."""
    layer = {k: v for k, v in config.items() if k not in ("eagle_config", "draft_vocab_size", "target_hidden_size",
                                                          "eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states")}
    layer["architectures"] = ["LlamaForCausalLM"]
    out = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        # vLLM's speculators reader defaults this to true; eyas' drafter adds the un-normed hidden (false).
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target},
        },
    }
    if "target_hidden_size" in config:
        out["target_hidden_size"] = config["target_hidden_size"]
    if "eagle_aux_hidden_state_layer_ids" in config:  # vLLM reads speculators ids as-is
        out["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
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


def write_draft_dir(out: Path, config: dict, tensors: dict[str, torch.Tensor], card: str) -> Path:
    """Write config.json, model.safetensors and README.md into ``out``, atomically (temp dir + rename)."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "README.md").write_text(card)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def export_run(run_dir: Path, out: Path, dtype: str = "bf16", fmt: str = "eagle3") -> Path:
    """Export RUN_DIR/final (what ``eyas train`` wrote) as an EAGLE-3 drafter directory (or speculators format)."""
    from eyas.export.card import model_card
    from eyas.target.layout import text_config
    from eyas.target.loading import load_target_config

    run_dir = Path(run_dir)
    final = run_dir / "final"
    if not (final / "model.safetensors").is_file():
        raise EyasError(f"{run_dir} has no final/model.safetensors: train it first (eyas train ... --out {run_dir})")
    if dtype not in TORCH_DTYPES:
        raise EyasError(f"--dtype must be bf16, fp16 or fp32, not {dtype!r}")
    drafter = DrafterConfig.from_dict(json.loads((final / "drafter_config.json").read_text()))
    options = json.loads((run_dir / "train_options.json").read_text())
    target_config, _ = load_target_config(options["target"], bool(options.get("trust_remote_code")))
    text = text_config(target_config)
    config = draft_config(drafter, text.model_type, int(text.num_hidden_layers), dtype)
    tensors = draft_tensors(load_file(str(final / "model.safetensors")), config, dtype)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
    card = model_card(config, options, report, Path(out).name)
    if fmt == "speculators":
        config = speculators_config(config, str(options["target"]))
    elif fmt != "eagle3":
        raise EyasError(f"--format must be eagle3 or speculators, not {fmt!r}")
    return write_draft_dir(out, config, tensors, card)
