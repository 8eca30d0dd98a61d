"""Capture fails loudly, naming cause and fix, whenever its hooks could not see the real forward."""

import copy

import pytest
import torch
from torch import nn

import zoo
from eyas.errors import CaptureError
from eyas.target import capture_hidden_states, discover_layout


@pytest.fixture
def llama():
    model = zoo.llama()
    return model, discover_layout(model)


IDS = torch.randint(1, 240, (1, 7), generator=torch.Generator().manual_seed(0))


def test_compiled_model_is_refused(llama):
    model, layout = llama
    with pytest.raises(CaptureError, match=r"torch\.compile.*_orig_mod"):
        capture_hidden_states(torch.compile(model), layout, IDS)


def test_a_layer_compiled_with_its_hooks_is_refused(llama):
    model, layout = llama
    model.model.layers[3].compile()  # nn.Module.compile: the layer's hooks inside the compiled call
    with pytest.raises(CaptureError, match=r"model\.layers\.3 is compiled"):
        capture_hidden_states(model, layout, IDS)


def test_a_compiled_forward_above_the_layers_is_refused(llama):
    model, layout = llama
    model.model.forward = torch.compile(model.model.forward)  # every layer's call, hooks and all, inside its graph
    with pytest.raises(CaptureError, match=r"^model is compiled"):
        capture_hidden_states(model, layout, IDS)


def test_compiled_layer_forwards_capture_what_the_eager_forward_captures(llama):
    """A layer's compiled forward runs inside the layer's call, its hooks around it: capture takes it (the GPU's
    --compile-layers), the taps fire once each, and the states are the eager forward's; the layers are as they were
    afterwards. Off CUDA, compile_layers compiles nothing."""
    from eyas.target.capture import fused_decoder_layers

    model, layout = llama
    ids = torch.randint(1, 240, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    eager = capture_hidden_states(model, layout, ids, attention_mask=mask)
    seen = []  # whether a layer ran its own forward or a compiled one, as each capture ran it
    handle = layout.layers[0].register_forward_pre_hook(lambda layer, args: seen.append("forward" in vars(layer)))
    capture_hidden_states(model, layout, ids, attention_mask=mask, compile_layers=True)
    assert seen == [False]  # a CPU target: eager
    with fused_decoder_layers(layout):
        fused = capture_hidden_states(model, layout, ids, attention_mask=mask)
    handle.remove()
    assert seen == [False, True]
    assert all("forward" not in vars(layer) for layer in layout.layers)
    for row in range(2):
        for got, want in zip(fused.sequence(row), eager.sequence(row)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_layer_compilation_that_fails_names_the_flag_that_avoids_it(llama, monkeypatch):
    import eyas.target.capture as capture
    from eyas.target.capture import fused_decoder_layers

    def failing(layer_class):
        def forward(*args, **kwargs):
            raise torch._dynamo.exc.InternalTorchDynamoError("an operator inductor cannot lower")
        return forward

    model, layout = llama
    monkeypatch.setattr(capture, "_compiled_forward", failing)
    with pytest.raises(CaptureError, match=r"compiling the target's decoder layers .*cannot lower.*--no-compile-layers"):
        with fused_decoder_layers(layout):
            capture_hidden_states(model, layout, IDS)
    assert all("forward" not in vars(layer) for layer in layout.layers)
    capture_hidden_states(model, layout, IDS)  # the model as it was


def test_layers_swapped_out_after_discovery_raise_did_not_fire(llama):
    model, layout = llama
    # e.g. a quantization library rebuilding the stack: the discovered modules no longer run
    model.model.layers = nn.ModuleList(copy.deepcopy(layer) for layer in model.model.layers)
    with pytest.raises(CaptureError, match=r"model\.layers\.2 input \(layer id 2\) did not fire(.|\n)*swapped out"):
        capture_hidden_states(model, layout, IDS)


def test_replayed_decoder_raises_and_names_cuda_graphs(llama):
    model, layout = llama
    # What CUDA-graph replay looks like to hooks: outputs appear, no module runs.
    with torch.no_grad():
        recorded = model.model(input_ids=IDS)
    model.model.forward = lambda *args, **kwargs: recorded
    with pytest.raises(CaptureError, match=r"did not fire(.|\n)*CUDA graph"):
        capture_hidden_states(model, layout, IDS)


def test_hook_firing_twice_is_refused(llama):
    model, layout = llama
    layers = model.model.layers
    layers[3] = layers[2]  # one layer object at two depths
    with pytest.raises(CaptureError, match="fired 2 times in one forward"):
        capture_hidden_states(model, layout, IDS)


def test_token_count_change_inside_the_forward_is_refused(llama):
    model, layout = llama
    original = model.forward

    def forward_with_an_extra_token(input_ids, attention_mask=None, **kwargs):
        embeds = model.model.embed_tokens(input_ids)
        embeds = torch.cat([embeds[:, :1], embeds], dim=1)  # like expanding a placeholder
        return original(inputs_embeds=embeds, **kwargs)

    model.forward = forward_with_an_extra_token
    with pytest.raises(CaptureError, match=r"shape \[1, 8, 64\], expected \[1, 7, 64\]"):
        capture_hidden_states(model, layout, IDS)


def test_transform_between_norm_and_lm_head_is_refused(llama):
    model, layout = llama
    decoder_forward = model.model.forward

    def forward_scaling_after_the_norm(*args, **kwargs):  # as MiniCPM scales before its head
        out = decoder_forward(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state / 2
        return out

    model.model.forward = forward_scaling_after_the_norm
    with pytest.raises(CaptureError, match="lm_head consumed differs from the final norm"):
        capture_hidden_states(model, layout, IDS)


def test_left_padding_is_refused_with_the_fix(llama):
    model, layout = llama
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="padding_side='right'"):
        capture_hidden_states(model, layout, IDS, attention_mask=mask)


def test_training_mode_model_is_captured_in_eval_and_restored(llama):
    model, layout = llama
    model.config.attention_dropout = 0.5
    model.train()
    a = capture_hidden_states(model, layout, IDS)
    b = capture_hidden_states(model, layout, IDS)
    assert torch.equal(a.aux, b.aux)
    assert model.training
