"""Layer ids: the one convention eyas uses, and how the engines spell the same taps.

eyas layer id ``L`` is the residual stream *entering* decoder layer ``L`` — the output of
layer ``L-1``, HF ``output_hidden_states[L]`` for ``0 < L < N``. This is vLLM's meaning. Id
``0`` is the token embedding entering layer 0 and id ``N`` the last layer's output before the
final norm. Other tools write other numbers for the same tensors, so every place that reads or
writes ids from outside converts through this module and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

from eyas.errors import EyasError


class LayerIdError(EyasError, ValueError):
    """Layer ids that cannot be used for this target (the message says which to pass instead)."""


# SGLang (0.5.x) families whose explicit ids are used as-is unless the first id is 1
# (then all get +1): DeepSeek-V2/V3 and the Kimi language models built on them.
_SGLANG_DEEPSEEK_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl"}
# SGLang gpt-oss: as-is when the largest id equals the layer count, else +1.
_SGLANG_GPT_OSS_TYPES = {"gpt_oss"}


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default taps (2, N//2, N-3): low, middle and high features, in eyas ids."""
    if num_layers < 6:
        # Below 6 layers the three defaults collide or fall outside the stack.
        raise LayerIdError(
            f"a target with {num_layers} decoder layers is too shallow for the default EAGLE-3 "
            "taps (2, N//2, N-3); pass explicit layer ids, e.g. --layer-ids 1,2,3"
        )
    return (2, num_layers // 2, num_layers - 3)


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Check ids are strictly increasing (low→mid→high) and within 0..N; return them as a tuple."""
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        raise LayerIdError("layer ids are empty; EAGLE-3 taps three layers, e.g. (2, N//2, N-3)")
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise LayerIdError(
            f"layer ids {list(ids)} must be strictly increasing: the drafter's fc reads them "
            "concatenated low→mid→high"
        )
    if ids[0] < 0 or ids[-1] > num_layers:
        raise LayerIdError(
            f"layer ids {list(ids)} fall outside 0..{num_layers} for a {num_layers}-layer target "
            f"(id L = input of decoder layer L; id {num_layers} = output of the last layer)"
        )
    return ids


def resolve_layer_ids(given: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """The ids to tap on a ``num_layers``-layer target: ``given`` (None or empty: the defaults), validated."""
    return validate_layer_ids(given or default_layer_ids(num_layers), num_layers)


def is_default_layer_ids(layer_ids: Sequence[int], num_layers: int) -> bool:
    """Whether ``layer_ids`` are the defaults the engines tap when a drafter names none (a target under 6 layers has
    no defaults: never)."""
    try:
        return tuple(layer_ids) == default_layer_ids(num_layers)
    except LayerIdError:
        return False


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """Parse ``"2,15,27"`` (or ``"[2, 15, 27]"``) into a tuple of ints."""
    cleaned = text.strip().strip("[]()")
    try:
        return tuple(int(part) for part in cleaned.split(",") if part.strip())
    except ValueError:
        raise LayerIdError(f"cannot read layer ids from {text!r}; write them like 2,15,27") from None


def output_spelling(layer_ids: Sequence[int]) -> tuple[int, ...]:
    """eyas ids → output-of-layer ids (SpecForge's and vLLM's block drafters' ``target_layer_ids``): the input of layer
    L is the output of layer L-1. Id 0 (the embeddings) comes out as -1; :func:`specforge_spelling` refuses it."""
    return tuple(i - 1 for i in layer_ids)


def from_output_spelling(output_ids: Sequence[int]) -> tuple[int, ...]:
    """Output-of-layer ids → eyas ids: the output of layer i is the input of layer i + 1 (inverse of
    :func:`output_spelling`)."""
    return tuple(i + 1 for i in output_ids)


def specforge_spelling(layer_ids: Sequence[int]) -> tuple[int, ...]:
    """SpecForge writes output-of-layer ids: the input of layer L is the output of layer L-1."""
    if min(layer_ids) < 1:
        raise LayerIdError("id 0 (the embeddings) has no output-of-layer spelling")
    return output_spelling(layer_ids)


def sglang_spelling(layer_ids: Sequence[int], model_type: str, num_layers: int) -> tuple[int, ...] | None:
    """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang capture these eyas ids.

    SGLang converts explicit ids per model family (Llama and most others: +1 always;
    DeepSeek/Kimi: +1 only when the first id is 1; gpt-oss: as-is when the last id is N).
    Returns None when no spelling makes that family capture exactly these tensors.
    """
    ids = tuple(layer_ids)
    if model_type in _SGLANG_DEEPSEEK_TYPES:
        # As-is works unless the first id is 1 (SGLang would shift it); the shifted spelling
        # needs a first id of 1 too, i.e. eyas ids starting at 2 — which as-is already covers.
        return ids if ids[0] != 1 else None
    if model_type in _SGLANG_GPT_OSS_TYPES and ids[-1] == num_layers:
        return ids
    if ids[0] < 1:
        return None
    return output_spelling(ids)


def sglang_reads(spelled: Sequence[int], model_type: str, num_layers: int) -> tuple[int, ...]:
    """What SGLang captures (in eyas ids) when a drafter config carries ``spelled``."""
    ids = tuple(spelled)
    if model_type in _SGLANG_DEEPSEEK_TYPES:
        return from_output_spelling(ids) if ids[0] == 1 else ids
    if model_type in _SGLANG_GPT_OSS_TYPES and ids[-1] == num_layers:
        return ids
    return from_output_spelling(ids)
