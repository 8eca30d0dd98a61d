"""The vLLM engine settings of a capture: what the user asked for, and eyas' default for each thing left out that the
capture needs, each default said in one line.

Pure rules over facts (the target's config.json, the platform), so they are tested without vLLM; the worker
(vllm_worker.py, under the vLLM Python, where eyas is not installed) loads this file by path and gathers the facts
with :func:`amx_available` and :func:`read_config`. Standard library only.
"""

from __future__ import annotations

# What vLLM's MLA layers rotate with (model_executor/models/deepseek_v2.py, DeepseekV2MLAAttention): rope_type
# "default" gets RotaryEmbedding, whose forward_cpu runs the CPU custom op (rotary_embedding/base.py) that MLA's
# strided q_pe/k_pe views corrupt; every other rope_type becomes DeepseekScalingRotaryEmbedding (deepseek_yarn,
# deepseek_llama_scaling), which has no CPU op and runs forward_native.
ROTARY_OP = "rotary_embedding"
# What transformers' DeepseekV3 computes (sigmoid scores, e_score_correction_bias, group-limited top-k) and a
# DeepseekV3Config saved by transformers does not say; vLLM's default (softmax, no bias) then fails on the
# checkpoint's e_score_correction_bias.
DEEPSEEK_V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def target_facts(config: dict) -> dict:
    """What the defaults depend on, from the target's config.json (a wrapper's text_config when it has one)."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return {
        "model_type": text.get("model_type"),
        "mla": text.get("kv_lora_rank") is not None,
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
        "routing": {key: text[key] for key in DEEPSEEK_V3_ROUTING if text.get(key) is not None},
    }


def choose_settings(request: dict, on_cpu: bool, amx: bool, target: dict) -> tuple[dict, list[str]]:
    """The LLM(...) settings: ``request``'s (None = not given), and for each not given that the capture needs, eyas'
    default; the notes say each default chosen and why, one line each.

    ``amx``: vLLM's own test (CpuPlatform: x86 and torch.cpu._is_amx_tile_supported()); with it vLLM runs an MLA
    target on its AMX_MLA backend, which takes bf16 weights only, unless CPU_MLA is asked for.
    """
    settings = {key: value for key, value in request.items() if value is not None}
    notes: list[str] = []
    mla_on_cpu = on_cpu and target["mla"]
    backend = str(settings.get("attention_backend", "")).upper()
    amx_mla = mla_on_cpu and amx and backend != "CPU_MLA"
    if "dtype" not in settings:
        if not on_cpu:
            settings["dtype"], why = "auto", "on a GPU: the checkpoint's dtype"
        elif amx_mla:
            settings["dtype"], why = "bfloat16", "MLA on an AMX CPU: vLLM's AMX_MLA backend takes bf16 only"
        else:
            settings["dtype"], why = "float32", "on CPU: the states match an fp32 transformers forward"
        notes.append(f"dtype={settings['dtype']} ({why}; --vllm-dtype to choose)")
    elif amx_mla and settings["dtype"] != "bfloat16" and not backend:
        settings["attention_backend"] = "CPU_MLA"
        notes.append(f"attention_backend=CPU_MLA (dtype {settings['dtype']} on an AMX CPU: AMX_MLA takes bf16 only; "
                     "--attention-backend to choose)")
    if mla_on_cpu and target["rope_type"] == "default":
        compilation = dict(settings.get("compilation_config") or {})
        ops = list(compilation.get("custom_ops") or [])
        if not any(op.lstrip("+-") == ROTARY_OP for op in ops):
            compilation["custom_ops"] = [*ops, f"-{ROTARY_OP}"]
            settings["compilation_config"] = compilation
            notes.append(f"compilation_config.custom_ops += -{ROTARY_OP} (vLLM's CPU rotary op corrupts MLA's strided "
                         f"q_pe/k_pe under default RoPE; '+{ROTARY_OP}' in --compilation-config keeps the op)")
    if target["model_type"] == "deepseek_v3" and len(target["routing"]) < len(DEEPSEEK_V3_ROUTING):
        overrides = dict(settings.get("hf_overrides") or {})
        missing = {k: v for k, v in DEEPSEEK_V3_ROUTING.items() if k not in target["routing"] and k not in overrides}
        if missing:
            settings["hf_overrides"] = {**overrides, **missing}
            notes.append(f"hf_overrides {missing} (the config.json does not say; these are what transformers' "
                         "DeepseekV3 computes, and vLLM's defaults fail on e_score_correction_bias)")
    settings.setdefault("enforce_eager", True)  # no torch.compile or graph capture for a one-token prefill per request
    return settings, notes


def amx_available() -> bool:
    """vLLM's own test for its AMX kernels (vllm/platforms/cpu.py: x86 and AMX tiles)."""
    import torch
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform

    return CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()


def read_config(model: str) -> dict:
    """The target's config.json as a dict (a local directory or a hub id; no remote code runs)."""
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(model)[0]
