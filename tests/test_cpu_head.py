"""On a CPU the two vocabulary projections of decoding (the target's lm_head in the fused forward, the drafter's) read
their weights prepacked for oneDNN: the same logits as F.linear to float32 rounding, any number of rows."""

import pytest
import torch
import torch.nn.functional as F

from eyas.engine.cpu_head import packed_head, vocab_head
from eyas.engine.draft_runner import DraftRunner
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


def test_no_packed_head_where_it_does_not_apply():
    half = torch.nn.Linear(64, 100, bias=False).bfloat16()
    biased = torch.nn.Linear(64, 100)
    assert packed_head(half) is None and vocab_head(half) is half  # half precision keeps its own matmul
    assert packed_head(biased) is None and vocab_head(biased) is biased


def test_decoding_on_a_cpu_projects_through_packed_heads():
    model = ARCHITECTURES["llama"][0]()
    runner = TargetRunner(model, discover_layout(model), None, 32, lean=True)
    assert runner.fused is not None and runner.fused.head is not model.lm_head
    runner.close()
    drafter = random_drafter(tiny_config())
    assert DraftRunner(drafter, 32)._head is not drafter.lm_head
