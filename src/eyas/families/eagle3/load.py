"""Import an EAGLE-3 drafter directory (eyas', SpecForge's, the EAGLE reference's, speculators') into eyas' own form."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.families.eagle3.config import DrafterConfig, drafter_rope
from eyas.errors import EyasError
from eyas.export.fit import layer_ids_of
from eyas.families.eagle3.contract import EAGLE31, flat_config, variant_problems
from eyas.export.files import read_tensors
from eyas.export.files import read_draft_config
from eyas.target.layer_ids import resolve_layer_ids

def import_draft_dir(directory: Path, target_layers: int | None = None) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(DrafterConfig, tensors with eyas names and a d2t) of a drafter directory.

    Reads eyas' and SpecForge's layout (``midlayer.*`` safetensors, optionally sharded), the EAGLE
    reference's (``pytorch_model.bin``, read as plain tensors only; config without layer ids or
    head_dim; RoPE scaling as ``rope_scaling``) and vLLM speculators' (``layers.0.*``, the Llama
    config nested, the target's embedding included, ``norm_before_residual``). Layer ids: vLLM's
    reading (top-level ids, else eagle_config's, as-is); when the directory names none, the defaults
    of a ``target_layers``-layer target.
    """
    directory = Path(directory)
    raw = read_draft_config(directory)
    config = flat_config(raw)
    problems = variant_problems(config)  # importing such a layer would measure another network than the engines run
    if problems:
        raise EyasError(f"{directory}: {'; '.join(problems)}")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise EyasError(f"{directory} has {config['num_hidden_layers']} drafter layers; eyas runs single-layer EAGLE-3 drafters")
    tensors = read_tensors(directory)
    tensors.pop("t2d", None)
    if "midlayer.hidden_norm.weight" not in tensors or "fc.weight" not in tensors:
        raise EyasError(f"{directory} is not an EAGLE-3 drafter (no midlayer.hidden_norm / fc): EAGLE-1/2 drafters read "
                        "one target state, not three")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    vocab = int(config["vocab_size"])
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    ids = layer_ids_of(config)
    if ids is None:
        if target_layers is None:
            raise EyasError(f"{directory} names no layer ids (engine defaults); give the target so eyas knows its depth")
        ids = list(resolve_layer_ids(None, target_layers))
    rope = drafter_rope(config.get("rope_parameters") or config.get("rope_scaling"), config.get("rope_theta") or 10000.0)
    tensors.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
    drafter = DrafterConfig(
        hidden_size=hidden, target_hidden_size=int(config.get("target_hidden_size") or hidden), num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads), head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config["rms_norm_eps"]), vocab_size=vocab,
        draft_vocab_size=draft_vocab, max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rope_parameters=rope, layer_ids=[int(i) for i in ids], hidden_act=config.get("hidden_act", "silu"),
        # the speculators format defaults it to true (vLLM's reader); HF-style configs to false
        norm_before_residual=bool(raw.get("norm_before_residual", "speculators_model_type" in raw)),
        **{key: bool(config.get(key)) for key in EAGLE31},
    )
    return drafter, tensors


def load_drafter(directory: Path, target_embedding: torch.Tensor, target_layers: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """An :class:`Eagle3Drafter` ready to draft: a drafter directory's weights, the target's embedding
    (when the directory holds none — SGLang and vLLM take the target's too), eval mode."""
    from eyas.families.eagle3.model import Eagle3Drafter

    config, tensors = import_draft_dir(directory, target_layers)
    drafter = Eagle3Drafter(config, d2t=tensors.pop("d2t"))
    if "embed_tokens.weight" not in tensors:
        if drafter.owns_embedding:
            raise EyasError(f"{directory} is {config.hidden_size} wide, its target {config.target_hidden_size}: "
                            "such a drafter must ship its own embed_tokens.weight, and this one does not")
        tensors["embed_tokens.weight"] = target_embedding.detach().to("cpu")
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise EyasError(f"{directory}: tensors missing {missing}, not understood {unexpected}")
    return drafter.to(device=device, dtype=dtype).eval()
