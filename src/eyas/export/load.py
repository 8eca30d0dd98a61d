"""Import an EAGLE-3 drafter directory (eyas', SpecForge's, the EAGLE reference's) into eyas' own form."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.drafter.config import DrafterConfig
from eyas.errors import EyasError
from eyas.export.contract import flat_config
from eyas.target.layer_ids import default_layer_ids


def import_draft_dir(directory: Path, target_layers: int | None = None) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(DrafterConfig, tensors with eyas names and a d2t) of a drafter directory.

    Layer ids: vLLM's reading (top-level ids, else eagle_config's, as-is); when the directory names
    none, the defaults of a ``target_layers``-layer target.
    """
    directory = Path(directory)
    config = flat_config(json.loads((directory / "config.json").read_text()))
    tensors = {name.replace("layers.0.", "midlayer.", 1): t for name, t in load_file(str(directory / "model.safetensors")).items()}
    tensors.pop("t2d", None)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    vocab = int(config["vocab_size"])
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target_layers is None:
            raise EyasError(f"{directory} names no layer ids (engine defaults); give the target so eyas knows its depth")
        ids = list(default_layer_ids(target_layers))
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", float(config.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", (config.get("rope_scaling") or {}).get("rope_type", "default"))
    tensors.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
    drafter = DrafterConfig(
        hidden_size=hidden, target_hidden_size=int(config.get("target_hidden_size") or hidden), num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads), head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config["rms_norm_eps"]), vocab_size=vocab,
        draft_vocab_size=draft_vocab, max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rope_parameters=rope, layer_ids=[int(i) for i in ids], hidden_act=config.get("hidden_act", "silu"),
    )
    return drafter, tensors
