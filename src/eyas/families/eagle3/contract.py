"""The EAGLE-3 drafter directory both engines load (docs/architecture.md, "Export contract").

One place says which tensors a drafter directory holds and in which shapes; the exporter writes by
it, ``eyas check`` validates against it, the importer reads by it.
"""

from __future__ import annotations

from eyas.export.fit import layer_ids_of

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the only Llama EAGLE-3 name SGLang resolves; vLLM maps it too
FLOAT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
LAYER_TENSORS = (
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)


def expected_shapes(config: dict) -> dict[str, list[int]]:
    """Tensor name → shape for a drafter ``config.json`` (d2t and embed_tokens included when required)."""
    hidden = int(config["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    vocab, draft_vocab = int(config["vocab_size"]), int(config.get("draft_vocab_size") or config["vocab_size"])
    aux = int(config.get("num_aux_hidden_states") or len(layer_ids_of(config) or [0, 0, 0]))
    shapes = {
        "fc.weight": [hidden, aux * target_hidden],
        "midlayer.input_layernorm.weight": [hidden],
        "midlayer.hidden_norm.weight": [hidden],
        "midlayer.self_attn.q_proj.weight": [heads * head_dim, 2 * hidden],
        "midlayer.self_attn.k_proj.weight": [kv_heads * head_dim, 2 * hidden],
        "midlayer.self_attn.v_proj.weight": [kv_heads * head_dim, 2 * hidden],
        "midlayer.self_attn.o_proj.weight": [hidden, heads * head_dim],
        "midlayer.post_attention_layernorm.weight": [hidden],
        "midlayer.mlp.gate_proj.weight": [inter, hidden],
        "midlayer.mlp.up_proj.weight": [inter, hidden],
        "midlayer.mlp.down_proj.weight": [hidden, inter],
        "norm.weight": [hidden],
        "lm_head.weight": [draft_vocab, hidden],
    }
    if draft_vocab < vocab:
        shapes["d2t"] = [draft_vocab]
    if hidden != target_hidden:
        shapes["embed_tokens.weight"] = [vocab, hidden]
    return shapes


def flat_config(config: dict) -> dict:
    """A drafter config in the HF EAGLE-3 shape; speculators-format configs are flattened into it."""
    if "speculators_model_type" not in config:
        return config
    flat = dict(config.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm",
                "norm_output"):
        if key in config:
            flat[key] = config[key]
    flat["architectures"] = [ARCHITECTURE]
    flat["eagle_config"] = {"use_aux_hidden_state": True}
    return flat
