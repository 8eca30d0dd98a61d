"""On a CPU the two vocabulary projections of decoding (the target's lm_head in the fused forward, the drafter's) read
their weights prepacked for oneDNN: the same logits as F.linear to the dtype's rounding (float32, bf16), any number of
rows."""

import pytest
import torch
import torch.nn.functional as F

from eyas.engine.cpu_head import packed_head, vocab_head
from eyas.families.eagle3.runner import DraftRunner
from eyas.engine.target_runner import TargetRunner
from eyas.target.layout import discover_layout
from test_drafter_consistency import random_drafter, tiny_config
from zoo import ARCHITECTURES


@pytest.mark.parametrize("rows", [1, 4, 6, 17])
def test_a_packed_head_gives_f_linears_logits(rows):
    linear = torch.nn.Linear(64, 1000, bias=False)
    head = packed_head(linear)
    assert head is not None  # the CPU build of torch has oneDNN
    x = torch.randn(2, rows, 64)
    assert torch.allclose(head(x), F.linear(x, linear.weight), rtol=1e-5, atol=1e-5)


def bf16_packing() -> bool:
    """Whether this CPU's oneDNN packs bf16 weights (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU
    refuses)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 8)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_a_packed_bf16_head_gives_f_linears_logits_to_bf16_rounding(rows):
    """Where oneDNN packs bf16 the head is packed; where it cannot, decoding keeps the linear itself. Either way the
    logits are F.linear's to bf16 rounding."""
    linear = torch.nn.Linear(64, 1000, bias=False).bfloat16()
    head = vocab_head(linear)
    if bf16_packing():
        assert packed_head(linear) is not None and head is not linear
    else:
        assert packed_head(linear) is None and head is linear
    x = torch.randn(2, rows, 64).bfloat16()
    assert head(x).dtype == torch.bfloat16
    assert torch.allclose(head(x).float(), F.linear(x, linear.weight).float(), rtol=1.6e-2, atol=1.6e-2)


def test_a_compiled_packed_head_traces_f_linear():
    """inductor cannot lower oneDNN's prepacked weight: under torch.compile the head is F.linear over the same weight
    (where bf16 is not packed, the head is the linear itself)."""
    linear = torch.nn.Linear(64, 1000, bias=False).bfloat16()
    head = vocab_head(linear)
    x = torch.randn(1, 3, 64).bfloat16()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(head, dynamic=False)(x), torch.compile(lambda x: F.linear(x, linear.weight))(x))


def test_no_packed_head_where_it_does_not_apply():
    half = torch.nn.Linear(64, 100, bias=False).half()
    biased = torch.nn.Linear(64, 100)
    assert packed_head(half) is None and vocab_head(half) is half  # fp16 keeps its own matmul
    assert packed_head(biased) is None and vocab_head(biased) is biased


def test_decoding_on_a_cpu_projects_through_packed_heads():
    model = ARCHITECTURES["llama"][0]()
    runner = TargetRunner(model, discover_layout(model), None, 32, lean=True)
    assert runner.fused is not None and runner.fused.head is not model.lm_head
    runner.close()
    drafter = random_drafter(tiny_config())
    assert DraftRunner(drafter, 32)._head is not drafter.lm_head
