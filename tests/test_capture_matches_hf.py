"""Captured states are exactly transformers' own hidden states, for every architecture in the zoo."""

import pytest
import torch

import zoo
from eyas.target import capture_hidden_states, default_layer_ids, discover_layout


def hf_reference(model, layout, input_ids, **inputs):
    """HF output_hidden_states plus what lm_head consumes, computed without eyas' hooks."""
    seen = {}
    handle = layout.lm_head.register_forward_pre_hook(lambda m, args: seen.setdefault("head_input", args[0]))
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False, **inputs)
    finally:
        handle.remove()
    return out.hidden_states, seen["head_input"]


def assert_capture_is_hf(model, input_ids, **inputs):
    layout = discover_layout(model)
    ids = default_layer_ids(layout.num_layers)
    captured = capture_hidden_states(model, layout, input_ids, **inputs)
    hidden, head_input = hf_reference(model, layout, input_ids, **inputs)
    H = layout.hidden_size
    assert captured.layer_ids == ids == (2, 4, 5)
    assert captured.aux.shape == (input_ids.shape[0], input_ids.shape[1], 3 * H)
    assert captured.aux.dtype == torch.float32
    for k, layer_id in enumerate(ids):  # concatenated low → mid → high
        assert torch.equal(captured.aux[..., k * H : (k + 1) * H], hidden[layer_id]), f"layer id {layer_id}"
    assert torch.equal(captured.final, head_input), "final hidden must be exactly what lm_head consumes"
    assert torch.equal(captured.final, hidden[-1])


@pytest.mark.parametrize("arch", sorted(zoo.ARCHITECTURES))
def test_capture_equals_hf_output_hidden_states(arch):
    model = zoo.ARCHITECTURES[arch][0]()
    torch.manual_seed(1)
    input_ids = torch.randint(1, 240, (2, 13))
    assert_capture_is_hf(model, input_ids)


def test_capture_through_llava_with_an_image():
    model = zoo.llava()
    torch.manual_seed(2)
    text = torch.randint(1, 240, (1, 6))
    image = torch.full((1, zoo.LLAVA_IMAGE_TOKENS), zoo.IMAGE_TOKEN)
    input_ids = torch.cat([text[:, :2], image, text[:, 2:]], dim=1)
    pixel_values = torch.randn(1, 3, 16, 16)
    assert_capture_is_hf(model, input_ids, pixel_values=pixel_values)
    # The image really reached the text stack: other pixels give other states after it.
    layout = discover_layout(model)
    a = capture_hidden_states(model, layout, input_ids, pixel_values=pixel_values)
    b = capture_hidden_states(model, layout, input_ids, pixel_values=pixel_values + 1)
    assert torch.equal(a.aux[:, :2], b.aux[:, :2])
    assert not torch.allclose(a.aux[:, 2:], b.aux[:, 2:])


def test_capture_through_kimi_style_wrapper_with_an_image():
    model = zoo.kimi_style()
    torch.manual_seed(3)
    input_ids = torch.randint(1, 240, (1, 10))
    input_ids[0, 3:6] = zoo.IMAGE_TOKEN
    pixel_values = torch.randn(3, 12)
    layout = discover_layout(model)
    captured = capture_hidden_states(model, layout, input_ids, pixel_values=pixel_values)
    hidden, head_input = hf_reference(model, layout, input_ids, pixel_values=pixel_values)
    assert torch.equal(captured.aux[..., :64], hidden[2])
    assert torch.equal(captured.final, head_input)


def test_final_layer_id_n_is_the_last_layer_output_before_the_norm():
    model = zoo.llama()
    layout = discover_layout(model)
    input_ids = torch.randint(1, 240, (1, 9))
    captured = capture_hidden_states(model, layout, input_ids, layer_ids=(1, 4, layout.num_layers))
    seen = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("out", out))
    with torch.no_grad():
        model(input_ids=input_ids)
    handle.remove()
    last_out = seen["out"][0] if isinstance(seen["out"], tuple) else seen["out"]
    assert torch.equal(captured.aux[..., 128:], last_out)
    assert torch.equal(model.model.norm(last_out), captured.final)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_the_engine_feeds_the_drafter_the_states_training_captured(arch):
    """What the engine's target hands the drafter (a prefill, then decoding steps committed round by
    round) is what training captures from the whole sequence: same layers, same positions."""
    from eyas.engine.target_runner import TargetRunner

    model = zoo.ARCHITECTURES[arch][0]()
    layout = discover_layout(model)
    input_ids = torch.randint(1, 200, (1, 14), generator=torch.Generator().manual_seed(5))
    captured = capture_hidden_states(model, layout, input_ids)
    runner = TargetRunner(model, layout, None, 64)
    pieces = [runner.prefill(input_ids[:, :8])[1].clone()]
    start = 8
    with torch.no_grad():
        for n in (1, 3, 2):  # rounds of 1, 3 and 2 accepted tokens
            causal = torch.ones(n, n, dtype=torch.long).tril()
            runner.verify(torch.tensor([start]), input_ids[:, start:start + n], torch.arange(start, start + n).unsqueeze(0),
                          causal)
            pieces.append(runner.aux[:, :n].clone())
            start += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), captured.aux, rtol=1e-5, atol=1e-5)
