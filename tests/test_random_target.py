"""benchmarks/random_target.py: a target's shape (config and tokenizer, no weights) and seeded random weights beside
it make a target eyas loads with the original's architecture and tokenizer."""

from pathlib import Path

import pytest
import torch

import zoo

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def random_target(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import random_target

    return random_target


def test_a_shape_then_weights_is_the_targets_architecture_and_tokenizer(random_target, tmp_path):
    from safetensors.torch import load_file

    from eyas.target.loading import load_target

    original = load_target(str(zoo.save_chat_target(tmp_path / "target", num_hidden_layers=2)), device="cpu")
    random_target.main(["shape", str(tmp_path / "target"), str(tmp_path / "shape")])
    assert not list((tmp_path / "shape").glob("*.safetensors*"))  # what travels holds no weights
    random_target.main(["weights", str(tmp_path / "shape")])
    stand_in = load_target(str(tmp_path / "shape"), device="cpu")
    mine, theirs = dict(stand_in.model.named_parameters()), dict(original.model.named_parameters())
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert {t.dtype for t in load_file(tmp_path / "shape" / "model.safetensors").values()} == {torch.bfloat16}
    assert not torch.equal(mine["model.embed_tokens.weight"].float(), theirs["model.embed_tokens.weight"].float())
    text = "a stand-in reads text as the target does"
    assert stand_in.tokenizer(text).input_ids == original.tokenizer(text).input_ids


def test_weights_are_seeded_and_never_overwrite(random_target, tmp_path):
    from safetensors.torch import load_file

    zoo.save_chat_target(tmp_path / "target", num_hidden_layers=1)
    drawn = []
    for name in ("a", "b"):
        random_target.main(["shape", str(tmp_path / "target"), str(tmp_path / name)])
        random_target.main(["weights", str(tmp_path / name), "--seed", "3"])
        drawn.append(load_file(tmp_path / name / "model.safetensors"))
    assert drawn[0].keys() == drawn[1].keys() and all(torch.equal(drawn[0][k], drawn[1][k]) for k in drawn[0])
    with pytest.raises(SystemExit, match="already holds weights"):
        random_target.main(["weights", str(tmp_path / "a")])


def test_weights_for_a_multimodal_wrapper_take_the_class_eyas_loads_it_with(random_target, tmp_path):
    """A wrapped target (llava here, Kimi-K2.5's kind) has no causal-LM auto class: the stand-in is built as
    eyas.target.loading builds it."""
    from eyas.target.loading import load_target

    original = zoo.llava()
    original.config.save_pretrained(tmp_path / "shape")
    random_target.main(["weights", str(tmp_path / "shape")])
    stand_in = load_target(str(tmp_path / "shape"), device="cpu")
    assert type(stand_in.model) is type(original)
    assert {k: v.shape for k, v in stand_in.model.named_parameters()} == \
        {k: v.shape for k, v in original.named_parameters()}
