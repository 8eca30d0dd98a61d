"""One tap rule (eyas.target.taps) for every reader and writer of aux states: capture, the engine's target
forward — the HF forward's hooks and the fused Llama forward's direct writes — and the split of vLLM's states.

The engine must draft from exactly the tensors training captured: for a prompt, its aux states equal
capture_hidden_states' bit for bit in fp32, on every test architecture, through each of its forwards.
"""

import pytest
import torch

import zoo
from eyas.capture.vllm_client import split_states, worker_layer_ids
from eyas.engine.fused_llama import fused_support
from eyas.engine.target_runner import TargetRunner
from eyas.target import capture_hidden_states, discover_layout
from eyas.target.taps import Taps
from zoo import ARCHITECTURES

PROMPT = torch.randint(1, 240, (1, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("layer_ids", [None, (0, 4, zoo.LAYERS)], ids=["defaults", "embedding-and-final-norm-input"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_engine_taps_what_capture_taps_bit_for_bit(arch, layer_ids):
    model = ARCHITECTURES[arch][0]()
    layout = discover_layout(model)
    captured = capture_hidden_states(model, layout, PROMPT, layer_ids=layer_ids).aux
    length = PROMPT.shape[1]
    runner = TargetRunner(model, layout, layer_ids, capacity=length, lean=False)  # a cache the prompt's size
    _, aux = runner.prefill(PROMPT)
    assert torch.equal(aux, captured), f"{arch}: the engine's prefill taps other tensors than capture"
    forwards = {"HF": runner}
    if fused_support(model, layout) is None:
        forwards["fused"] = TargetRunner(model, layout, layer_ids, capacity=length, lean=True)
        assert forwards["fused"].fused is not None
    for name, engine in forwards.items():  # the prompt as one decoding step from an empty cache
        with torch.no_grad():
            engine.verify(torch.tensor([0]), PROMPT, torch.arange(length).unsqueeze(0),
                          torch.ones(length, length, dtype=torch.long).tril())
        assert torch.equal(engine.aux[:, :length], captured), f"{arch}: the {name} decoding forward taps other tensors"
        engine.close()


def test_the_vllm_split_puts_each_layer_id_in_the_slot_capture_does():
    """vLLM returns the states of the ids it was asked for ([T, m, H], the aux ids then N); the split must put
    each in the slot capture puts it in, and the final norm on id N gives capture's final hidden."""
    model = zoo.llama()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # ones would hide a missing norm
    layout = discover_layout(model)
    taps = Taps((2, 4, 5), zoo.LAYERS)
    tapped = worker_layer_ids(taps.layer_ids, zoo.LAYERS)
    assert tapped == (2, 4, 5, zoo.LAYERS)
    with torch.no_grad():
        hidden = model(PROMPT, output_hidden_states=True).hidden_states  # [L] = the input of decoder layer L, 0 < L < N
        pre_norm = capture_hidden_states(model, layout, PROMPT, layer_ids=(zoo.LAYERS,)).aux[0]
    states = torch.stack([*(hidden[i][0] for i in taps.layer_ids), pre_norm], dim=1)  # the worker's layout
    captured = capture_hidden_states(model, layout, PROMPT, layer_ids=taps.layer_ids)
    aux, final = split_states(states, tapped, taps, layout.norm)
    assert torch.equal(aux, captured.aux[0]) and torch.equal(final, captured.final[0])
    # ids in another order than the taps': each still lands in its own slot
    order = [3, 1, 0, 2]
    shuffled = split_states(states[:, order], tuple(tapped[i] for i in order), taps, layout.norm)[0]
    assert torch.equal(shuffled, captured.aux[0])


def test_a_tap_slot_is_the_ids_place_low_to_high():
    taps = Taps((2, 15, 27), 30)
    aux = torch.arange(2 * 12, dtype=torch.float).view(2, 12)  # k = 3 taps of width 4
    assert torch.equal(taps.view(aux, 1), aux[:, 4:8])
    assert (taps.entering(15), taps.entering(16), taps.entering(27)) == (1, None, 2)
    assert Taps(None, 30).layer_ids == (2, 15, 27)
    with pytest.raises(ValueError, match="strictly increasing"):
        Taps((15, 2, 27), 30)
    with pytest.raises(ValueError, match="lack the taps"):
        taps.assemble(torch.zeros(5, 2, 4), (2, 15))
