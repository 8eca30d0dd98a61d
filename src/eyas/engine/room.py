"""Whether a generation fits the target before its caches are allocated: the one bound ``eyas bench`` and
``eyas generate`` apply (:func:`checked_capacity`).

A generation needs a position for every prompt token, every answer token and the deepest draft a last round verifies:
no more than the target's config allows (``max_position_embeddings``, of the text config for a multimodal target;
a config without one is not bounded by positions). Its KV cache (:func:`eyas.engine.modes.target_capacity` slots:
the answer, the prompt and a round's drafts) must fit the memory left beside the loaded weights: the cache of one
target alone is counted, so a generation refused here could never run. Without these checks a long
``--max-new-tokens`` asked the allocator for hundreds of GiB and ended in a traceback; now it is one line saying what fits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eyas.engine.modes import Speculation, target_capacity
from eyas.errors import EyasError
from eyas.outputs import available_ram
from eyas.target.layout import text_config


def checked_capacity(target, prompt_tokens: int, new_tokens: int, modes: Sequence[Speculation], prompts: int = 1,
                     prompt_flag: str | None = None) -> int:
    """The target cache's slots for ``new_tokens`` after prompts of up to ``prompt_tokens`` (``prompts`` of them) in
    ``modes`` (:func:`target_capacity`), once they fit the loaded ``target``'s positions and its device's memory; else
    one line saying what fits. ``prompt_flag``: the option that bounds the prompts (bench's --max-prompt-tokens), in
    the advice when the prompts alone leave no room."""
    config = text_config(target.model.config)
    depth = max((mode.max_depth for mode in modes), default=0)
    needed = prompt_tokens + new_tokens + depth
    limit = getattr(config, "max_position_embeddings", None)
    said = f"--max-new-tokens {new_tokens} with {_prompts(prompt_tokens, prompts)}"
    drafts = f" and drafts {depth} deep" if depth else ""
    if isinstance(limit, int) and needed > limit:
        raise EyasError(f"{said}{drafts} needs {needed:,} positions; the target has {limit:,} (max_position_embeddings): "
                        f"{_advice(limit - prompt_tokens - depth, prompt_tokens, prompt_flag, '≤')}")
    capacity = target_capacity(prompt_tokens, new_tokens, modes)
    per_slot = kv_bytes_per_slot(config, target.model.dtype)
    free, where = free_memory(target.model)
    if free is not None and per_slot is not None and capacity * per_slot > free:
        most = free // per_slot - (capacity - new_tokens)  # the target's cache filling the memory: an upper bound
        raise EyasError(f"{said}{drafts} needs a KV cache of {capacity:,} slots, {_gib(capacity * per_slot)} for the "
                        f"target alone, and {where} has {_gib(free)} free: "
                        f"{_advice(most, prompt_tokens, prompt_flag, 'well under')}")
    return capacity


def _prompts(tokens: int, count: int) -> str:
    unit = "token" if tokens == 1 else "tokens"
    return f"a prompt of {tokens:,} {unit}" if count == 1 else f"prompts of up to {tokens:,} {unit}"


def _advice(most: int, prompt_tokens: int, prompt_flag: str | None, bound: str) -> str:
    """What to pass: ``bound`` (≤, well under) ``most`` new tokens, or when none fit, shorter prompts."""
    if most >= 1:
        return f"use --max-new-tokens {bound} {most:,}"
    shorter = f"lower {prompt_flag} (the longest prompt has {prompt_tokens:,} tokens)" if prompt_flag else \
        "shorten the prompt"
    return f"even one new token does not fit: {shorter}"


def _gib(count: int) -> str:
    return f"{count / 2**30:,.1f} GiB"


def kv_bytes_per_slot(config, dtype: torch.dtype) -> int | None:
    """Bytes one cache slot takes in every layer of the target's :class:`~eyas.engine.kv.SlotCache`: keys and values as
    its attention writes them (``num_key_value_heads`` × ``head_dim`` each; MLA: the compressed latent and the rope key,
    ``kv_lora_rank`` + ``qk_rope_head_dim``, what transformers 5 caches, measured on tests/zoo.py's DeepSeek-V3); None
    when the config does not say. Never more than the cache takes: a generation refused by it could never run."""
    try:
        layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
        if getattr(config, "kv_lora_rank", None):
            width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        else:
            head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
            width = 2 * int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * width * torch.empty((), dtype=dtype).element_size()


def free_memory(model: torch.nn.Module) -> tuple[int | None, str]:
    """(Bytes free where ``model``'s caches go, what that place is): the free memory of every GPU its weights sit on
    (its layers' caches follow them), else the RAM available to this process; None when it cannot be told."""
    gpus = sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)
    if gpus:
        return sum(torch.cuda.mem_get_info(gpu)[0] for gpu in gpus), ", ".join(str(gpu) for gpu in gpus)
    return available_ram(), "this machine's RAM"
