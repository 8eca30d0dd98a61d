"""A vocabulary projection (lm_head) on the CPU with its weight prepacked once for oneDNN.

On a CPU the lm_head is the largest matrix a decoding step reads (the demo target's: 49,152 × 576, 113 MB in
fp32), and BLAS is slow for the few rows a speculative round projects: on a 2-core EPYC, F.linear took 7–10 ms for
one row and 20–35 ms for four, where oneDNN's matmul over the prepacked weight took 4.3 and 2.6 ms
(benchmarks/LOG.md, "What limits speculation on a 2-core CPU"); in bf16 (a CPU with native bf16 decodes in it), 1.2
ms for one to four rows where F.linear took 3.5–4.5. Only the heads take this path: the decoder layers
keep the model's own arithmetic, so the hidden states the engine taps stay those capture records.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Head = Callable[[torch.Tensor], torch.Tensor]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}  # the dtypes packed, and how far from F.linear: their rounding


def vocab_head(linear: nn.Module, rows: int = 8) -> Head:
    """What decoding calls for ``linear`` (an lm_head): :func:`packed_head` where it applies, else ``linear`` itself."""
    return packed_head(linear, rows) or linear


def packed_head(linear: nn.Module, rows: int = 8) -> Head | None:
    """``x [..., in] → linear(x)`` through oneDNN with the weight [out, in] prepacked (for about ``rows`` rows at a
    time), or None where that does not apply: a bias, not a float32 or bf16 CPU weight, a torch without oneDNN's linear
    ops, or results that differ from F.linear's beyond the dtype's rounding (checked once, here)."""
    weight = linear.weight
    if (getattr(linear, "bias", None) is not None or weight.device.type != "cpu" or weight.dtype not in TOLERANCE
            or not torch.backends.mkldnn.is_available()):
        return None
    weight = weight.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

        def head(x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():  # inductor cannot lower a prepacked weight: it fuses F.linear itself
                return F.linear(x, weight)
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "").view(*x.shape[:-1], -1)

        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        tolerance = TOLERANCE[weight.dtype]
        if not torch.allclose(head(probe), F.linear(probe, weight), rtol=tolerance, atol=tolerance):
            return None
    except (AttributeError, RuntimeError):  # an older or differently built torch
        return None
    return head
