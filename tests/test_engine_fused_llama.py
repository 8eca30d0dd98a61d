"""The fused Llama-family forward computes what the HF forward computes: logits and aux states.

Both run as decoding steps of a TargetRunner over the same committed prefix, with a tree mask (scattered
visibility) and with a plain causal step; then whole generations through the fused path must equal the
uncached reference (test_engine_greedy's). Fusing the projections leaves the HF model computing exactly
what it computed before.
"""

import pytest
import torch

from eyas.engine.decode import generate
from eyas.speculation import Chain, Tree
from eyas.engine.drafting import ancestor_mask
from eyas.engine.fused_llama import fused_support
from eyas.engine.target_runner import TargetRunner
from eyas.target.layout import discover_layout
from test_engine_greedy import NEW_TOKENS, prompt_of, reference_greedy, runners
from zoo import ARCHITECTURES

FUSED = ["llama", "qwen2", "qwen3", "mistral"]


def step_outputs(model, fused: bool, tokens: torch.Tensor, parents: torch.Tensor | None):
    runner = TargetRunner(model, discover_layout(model), None, 64, lean=fused)
    assert (runner.fused is not None) == fused
    runner.prefill(prompt_of(2, length=9))
    depths = torch.zeros(len(tokens), dtype=torch.long)
    if parents is not None:
        for i in range(1, len(tokens)):
            depths[i] = depths[parents[i]] + 1
    else:
        depths = torch.arange(len(tokens))
    tree = ancestor_mask(parents) if parents is not None else torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    with torch.no_grad():
        logits = runner.verify(torch.tensor([9]), tokens.unsqueeze(0), (9 + depths).unsqueeze(0), tree.long())
    result = logits.clone(), runner.aux[:, : len(tokens)].clone()
    runner.close()
    return result


@pytest.mark.parametrize("arch", FUSED)
def test_fused_step_equals_the_hf_step(arch):
    model = ARCHITECTURES[arch][0]()
    before = model(prompt_of(4)).logits
    tokens = torch.tensor([5, 17, 99, 3, 42, 7])
    for parents in (None, torch.tensor([-1, 0, 0, 1, 2, 2])):  # a chain, then a tree
        hf_logits, hf_aux = step_outputs(model, False, tokens, parents)
        fused_logits, fused_aux = step_outputs(model, True, tokens, parents)
        assert torch.allclose(fused_logits, hf_logits, atol=1e-5, rtol=1e-4), f"{arch}: logits differ"
        assert torch.allclose(fused_aux, hf_aux, atol=1e-5, rtol=1e-4), f"{arch}: aux states differ"
    assert torch.equal(model(prompt_of(4)).logits, before), "fusing the projections changed the HF model"


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_fused_generation_is_lossless(arch):
    model = ARCHITECTURES[arch][0]()
    _, drafter = runners(model)
    target = TargetRunner(model, discover_layout(model), None, 128, lean=True)
    assert target.fused is not None
    prompt = prompt_of(6)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    for speculation in (None, Chain(4), Tree(top_k=4, depth=3, total=10)):
        assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == expected


@pytest.mark.parametrize("arch", ["gemma3_text", "deepseek_v3", "qwen3_moe"])
def test_other_architectures_keep_the_hf_forward(arch):
    model = ARCHITECTURES[arch][0]()
    layout = discover_layout(model)
    runner = TargetRunner(model, layout, None, 32, lean=True)
    assert runner.fused is None
    assert fused_support(model, layout) is not None  # a reason, for the log
