"""Layout discovery finds the text stack by rule, through wrappers, and explains when it cannot."""

import pytest
from torch import nn

import zoo
from eyas.errors import LayoutError
from eyas.target import discover_layout


@pytest.mark.parametrize("arch", sorted(zoo.ARCHITECTURES))
def test_layout_of_each_architecture(arch):
    build, layers_path = zoo.ARCHITECTURES[arch]
    model = build()
    layout = discover_layout(model)
    assert layout.layers_path == layers_path
    assert layout.layers is model.get_submodule(layers_path)
    assert layout.embed is model.get_input_embeddings()
    assert layout.lm_head is model.get_output_embeddings()
    assert layout.norm_path == layers_path.rsplit(".", 1)[0] + ".norm"
    assert (layout.num_layers, layout.hidden_size, layout.vocab_size) == (8, 64, 256)


def test_vision_tower_of_equal_depth_is_not_taken_for_the_text_stack():
    model = zoo.kimi_style()
    assert len(model.vision_tower.layers) == len(model.language_model.model.layers)
    assert discover_layout(model).layers_path == "language_model.model.layers"


def test_no_matching_stack_lists_what_was_found():
    model = zoo.llama()
    model.config.num_hidden_layers = 12  # the config disagrees with every list in the model
    with pytest.raises(LayoutError, match=r"wanted 12 entries(.|\n)*found: model\.layers \(8 × LlamaDecoderLayer\)"):
        discover_layout(model)


def test_missing_final_norm_lists_the_siblings():
    model = zoo.llama()
    del model.model.norm
    model.model.register_module("final", nn.Identity())
    with pytest.raises(LayoutError, match=r"no final norm(.|\n)*embed_tokens \(Embedding\)"):
        discover_layout(model)


def test_base_model_without_lm_head_is_explained():
    base = zoo.llama().model
    with pytest.raises(LayoutError, match="ForCausalLM"):
        discover_layout(base)
