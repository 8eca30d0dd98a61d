"""vLLM's speculators format of an eyas drafter: the same tensors, the Llama layer's config nested, the target named."""

from __future__ import annotations


def speculators_config(config: dict, target: str, speculative_tokens: int = 3) -> dict:
    """The same drafter in vLLM's speculators format (``vllm serve DRAFT_DIR`` finds the target itself)."""
    layer = {k: v for k, v in config.items() if k not in ("eagle_config", "draft_vocab_size", "target_hidden_size",
                                                          "eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states",
                                                          "fc_norm", "norm_output")}
    layer["architectures"] = ["LlamaForCausalLM"]
    out = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        # vLLM's speculators reader defaults this to true; eyas' drafter adds the un-normed hidden (false).
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(config.get("fc_norm")),  # EAGLE-3.1 (contract.EAGLE31)
        "norm_output": bool(config.get("norm_output")),
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
