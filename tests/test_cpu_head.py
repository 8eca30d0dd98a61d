"""On a CPU the two vocabulary projections of decoding (the target's lm_head in the fused forward, the drafter's) read
their weights prepacked for oneDNN: the same logits as F.linear to float32 rounding, any number of rows."""

import pytest
import torch
import torch.nn.functional as F

from eyas.engine.cpu_head import packed_head
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.target_runner import TargetRunner
from eyas.target.layout import discover_layout
from test_drafter_consistency import random_drafter, tiny_config
from zoo import ARCHITECTURES


@pytest.mark.parametrize("rows", [1, 4, 6, 17])
def test_a_packed_head_gives_f_linears_logits(rows):
    weight = torch.randn(1000, 64, generator=torch.Generator().manual_seed(1))
    head = packed_head(weight)
    assert head is not None  # the CPU build of torch has oneDNN
    x = torch.randn(2, rows, 64)
    assert torch.allclose(head(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_no_packed_head_where_it_does_not_apply():
    assert packed_head(torch.randn(100, 64).bfloat16()) is None  # half precision keeps its own matmul


def test_decoding_on_a_cpu_projects_through_packed_heads():
    model = ARCHITECTURES["llama"][0]()
    runner = TargetRunner(model, discover_layout(model), None, 32, lean=True)
    assert runner.fused is not None and runner.fused.head is not None
    runner.close()
    drafter = DraftRunner(random_drafter(tiny_config()), 32)
    assert drafter._head is not None
