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


# EAGLE-3.1's config switches, as vLLM (llama_eagle3.py) and SGLang read them from config.json's top level:
# fc_norm = an RMSNorm on each target state before fc (tensors fc_norm.{i}.weight), norm_output = the post-norm
# output is the next step's hidden (eyas.families.eagle3.model)
EAGLE31 = ("fc_norm", "norm_output")


def eagle31_switches(config: dict) -> list[str]:
    """The EAGLE-3.1 switches a (flat) drafter config.json sets, as the engines read them (the top level)."""
    return [key for key in EAGLE31 if config.get(key)]


def variant_problems(config: dict) -> list[str]:
    """Why eyas cannot compute the layer a (flat) drafter config.json describes as the engines would, [] when it can:
    ``norm_before_fc`` (an RMSNorm over the concatenated target states before fc, which eyas' drafter does not
    implement), or an EAGLE-3.1 switch in ``eagle_config`` that disagrees with the top level the engines read.
    Import refuses such a directory and ``eyas check`` reports it."""
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    problems = []
    if config.get("norm_before_fc") or nested.get("norm_before_fc"):
        problems.append("norm_before_fc is set: an RMSNorm over the concatenated target states before fc, a variant of "
                        "the EAGLE-3 layer outside the contract (the engines do not all run it, and eyas' drafter does "
                        "not implement it); drafters that load everywhere leave it unset")
    for key in EAGLE31:
        if nested.get(key) is not None and bool(nested[key]) != bool(config.get(key)):
            problems.append(f"eagle_config.{key} is {nested[key]} but the top-level {key} is {config.get(key)}: vLLM "
                            "and SGLang read the top level; set it there")
    return problems

SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
OPTIONAL_SIZES = ("draft_vocab_size", "target_hidden_size", "head_dim", "num_aux_hidden_states")


def kind_problems(config: dict, missing: bool = True) -> list[str]:
    """What in a (flat) drafter config.json is missing (with ``missing``) or of the wrong kind for anything to read it:
    its sizes positive whole numbers, rms_norm_eps a positive number, eagle_config and rope_parameters objects, the layer
    ids lists of ids (a hand edit, or a file another tool wrote); [] when every field can be read."""
    problems = []
    for key in SIZES + OPTIONAL_SIZES:
        value = config.get(key)
        if (value is not None or (key in SIZES and missing)) and (type(value) is not int or value < 1):
            problems.append(f"config field {key} is {'missing' if value is None else repr(value)}: a positive whole "
                            "number")
    eps = config.get("rms_norm_eps")
    if (eps is not None or missing) and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0):
        problems.append(f"config field rms_norm_eps is {eps!r}: a positive number")
    for key in ("eagle_config", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            problems.append(f"config field {key} is {config[key]!r}: an object")
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    for where, ids in (("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")),
                       ("eagle_config.eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))):
        if ids is not None and (not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids)):
            problems.append(f"config field {where} is {ids!r}: a list of layer ids (whole numbers ≥ 0)")
    return problems


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
    if config.get("fc_norm"):  # EAGLE-3.1: an RMSNorm on each target state before fc
        shapes.update({f"fc_norm.{i}.weight": [target_hidden] for i in range(aux)})
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
