"""Layer-id convention: defaults, validation, and the spellings other engines need."""

import re
from pathlib import Path

import pytest

from eyas.target.layer_ids import (
    LayerIdError,
    default_layer_ids,
    from_output_spelling,
    is_default_layer_ids,
    output_spelling,
    parse_layer_ids,
    resolve_layer_ids,
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


@pytest.mark.parametrize("given", [None, (), []])
def test_resolve_without_ids_gives_the_defaults(given):
    assert resolve_layer_ids(given, 30) == (2, 15, 27)


def test_resolve_checks_given_ids_and_returns_a_tuple():
    assert resolve_layer_ids([1, 4, 8], 8) == (1, 4, 8)
    with pytest.raises(LayerIdError) as err:
        resolve_layer_ids((2, 4, 9), 8)
    assert str(err.value) == ("layer ids [2, 4, 9] fall outside 0..8 for a 8-layer target (id L = input of decoder "
                              "layer L; id 8 = output of the last layer)")
    with pytest.raises(LayerIdError, match=re.escape("layer ids [5, 2, 8] must be strictly increasing")):
        resolve_layer_ids((5, 2, 8), 8)


def test_resolve_on_a_shallow_target_asks_for_explicit_ids():
    with pytest.raises(LayerIdError, match="too shallow.*--layer-ids 1,2,3"):
        resolve_layer_ids(None, 5)
    with pytest.raises(LayerIdError, match="strictly increasing"):  # 6 layers: the defaults (2, 3, 3) collide
        resolve_layer_ids(None, 6)
    assert resolve_layer_ids((1, 2, 3), 5) == (1, 2, 3)


def test_is_default_layer_ids():
    assert is_default_layer_ids([2, 15, 27], 30)
    assert not is_default_layer_ids((2, 15, 26), 30)
    assert not is_default_layer_ids((2, 15, 27, 30), 30)
    assert not is_default_layer_ids((1, 2, 3), 5)  # too shallow: no defaults, never "the defaults"


@pytest.mark.parametrize("ids", [(2, 15, 27), (1, 9, 17, 25, 33), (1,), (0, 4, 8)])
def test_output_spelling_round_trips(ids):
    assert from_output_spelling(output_spelling(ids)) == ids
    assert output_spelling(from_output_spelling(ids)) == ids


def test_output_spelling_counts_layer_outputs():
    assert output_spelling([2, 15, 27]) == (1, 14, 26)  # the input of layer L is the output of layer L - 1
    assert from_output_spelling([1, 9, 17, 25, 33]) == (2, 10, 18, 26, 34)  # DFlash's Qwen3-8B taps, in eyas ids
    assert specforge_spelling((2, 30, 58)) == output_spelling((2, 30, 58))
    with pytest.raises(LayerIdError, match="id 0"):
        specforge_spelling((0, 4, 6))  # SpecForge cannot name the embeddings


_SRC = Path(__file__).resolve().parents[1] / "src" / "eyas"


def _sources():
    return {path.relative_to(_SRC).as_posix(): path.read_text(encoding="utf-8") for path in sorted(_SRC.rglob("*.py"))}


def test_default_layer_ids_are_taken_only_through_layer_ids():
    """"Given ids, else the defaults, validated" is resolve_layer_ids's rule: no other module picks the defaults
    (target/describe.py only reports them)."""
    picks = re.compile(r"\bdefault_layer_ids\(")
    offenders = [name for name, text in _sources().items()
                 if name not in {"target/layer_ids.py", "target/describe.py"} and picks.search(text)]
    assert offenders == [], f"{offenders} call default_layer_ids(): use resolve_layer_ids / is_default_layer_ids"
    combined = [name for name, text in _sources().items() if name != "target/layer_ids.py"
                and re.search(r"\bvalidate_layer_ids\(", text) and picks.search(text)]
    assert combined == [], f"{combined} validate ids or the defaults themselves: use resolve_layer_ids"


def test_output_of_layer_ids_are_converted_only_in_layer_ids():
    """DFlash's "output of layer i" = eyas id i + 1 is spelled by output_spelling / from_output_spelling only."""
    pattern = re.compile(r"\[\s*\w+\s*[+-]\s*1\s+for\s+\w+\s+in\s+[^\]]*(layer_ids|outputs)")
    offenders = [name for name, text in _sources().items()
                 if name != "target/layer_ids.py" and pattern.search(text)]
    assert offenders == [], f"{offenders} shift layer ids by one themselves: use output_spelling / from_output_spelling"
