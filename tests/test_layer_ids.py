"""Layer-id convention: defaults, validation, and the spellings other engines need."""

import pytest

from eyas.target.layer_ids import (
    default_layer_ids,
    parse_layer_ids,
    sglang_reads,
    sglang_spelling,
    specforge_spelling,
    validate_layer_ids,
)


@pytest.mark.parametrize(("layers", "ids"), [(30, (2, 15, 27)), (61, (2, 30, 58)), (32, (2, 16, 29)), (8, (2, 4, 5))])
def test_default_taps_are_inputs_of_layers_2_half_and_n_minus_3(layers, ids):
    assert default_layer_ids(layers) == ids


def test_too_shallow_target_asks_for_explicit_ids():
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="too shallow.*--layer-ids"):  # a user error: the CLI prints it, no traceback
        default_layer_ids(5)


@pytest.mark.parametrize("bad", [(5, 2, 8), (2, 2, 5), (), (-1, 3, 4), (2, 4, 9)])
def test_invalid_ids_are_refused(bad):
    with pytest.raises(ValueError):
        validate_layer_ids(bad, 8)


def test_id_n_is_allowed_and_parsing_accepts_brackets():
    assert validate_layer_ids(parse_layer_ids("[2, 4, 8]"), 8) == (2, 4, 8)
    with pytest.raises(ValueError, match="2,15,27"):
        parse_layer_ids("two")


def test_specforge_writes_output_of_layer_ids():
    assert specforge_spelling((2, 30, 58)) == (1, 29, 57)


@pytest.mark.parametrize(
    ("model_type", "layers", "ids", "spelled"),
    [
        ("llama", 30, (2, 15, 27), (1, 14, 26)),  # SGLang adds +1 for Llama-family targets
        ("qwen3_moe", 48, (2, 24, 45), (1, 23, 44)),
        ("deepseek_v3", 61, (2, 30, 58), (2, 30, 58)),  # as-is when the first id is not 1
        ("kimi_k25", 61, (2, 30, 58), (2, 30, 58)),
        ("gpt_oss", 24, (2, 12, 24), (2, 12, 24)),  # as-is when the last id is N
        ("gpt_oss", 24, (2, 12, 21), (1, 11, 20)),
    ],
)
def test_sglang_spelling_makes_sglang_capture_the_same_tensors(model_type, layers, ids, spelled):
    assert sglang_spelling(ids, model_type, layers) == spelled
    assert sglang_reads(spelled, model_type, layers) == ids


def test_unexpressible_sglang_spellings_are_none():
    assert sglang_spelling((1, 30, 58), "deepseek_v3", 61) is None
    assert sglang_spelling((0, 4, 6), "llama", 8) is None
