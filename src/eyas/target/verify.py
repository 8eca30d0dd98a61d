"""Cross-check a capture against transformers' own ``output_hidden_states``.

An independent second path to the same tensors: HF's ``hidden_states[L]`` is the input of
decoder layer ``L`` for ``0 < L < N`` and its last entry is the final norm's output. The demo
runs this check so every user sees, on their machine, that capture taps the right tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.target.capture import CapturedStates
from eyas.target.layout import TargetLayout


def max_abs_diff_vs_hf(
    model: nn.Module, layout: TargetLayout, input_ids: torch.Tensor, captured: CapturedStates
) -> dict[str, float]:
    """Max |capture − HF| per layer id and for the final hidden, on an unpadded batch."""
    device = next(layout.embed.parameters()).device
    with torch.no_grad():
        out = model(input_ids=input_ids.to(device), output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states
    width = layout.hidden_size
    diffs = {}
    for k, layer_id in enumerate(captured.layer_ids):
        if not 0 < layer_id < layout.num_layers:
            continue  # HF's tuple holds ids 1..N-1 unambiguously; 0 and N are not compared
        mine = captured.aux[..., k * width : (k + 1) * width]
        diffs[f"layer {layer_id}"] = _max_abs(mine, hidden[layer_id])
    diffs["final"] = _max_abs(captured.final, hidden[-1])
    return diffs


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()
