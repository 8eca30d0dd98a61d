"""A fused decoding forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3).

The same arithmetic as the HF forward — it calls the model's own norms, rotary embedding,
activation and lm_head — with fewer kernels, which is what a small target's decode step costs on a
GPU (a decode step of the demo target is ~210 tiny matmuls and ~900 elementwise kernels through the
HF forward):
- q/k/v are one matmul and gate/up another: the projection weights are concatenated once, and the
  HF modules' weights become views into the concatenation (no second copy; the model is unchanged
  for everyone else);
- attention, on a GPU, is :mod:`eyas.engine.attention`'s two Triton kernels (the query heads of a
  key head as the rows of one tile, programs split across the cache); elsewhere HF's own (keys
  repeated per query head, then SDPA);
- the EAGLE-3 aux states are written straight into the runner's buffer where :class:`eyas.target.taps.Taps`
  puts them (no hooks), and keys and values into the runner's slot cache;
- on a CPU the lm_head reads its weight prepacked for oneDNN (:mod:`eyas.engine.cpu_head`).
The prefill and any other architecture use the HF forward. ``tests/test_engine_fused_llama.py`` pins the
fused forward to the HF one (logits and aux states, every supported architecture).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eyas.engine.attention import attend, kernels_available
from eyas.engine.cpu_head import vocab_head
from eyas.engine.kv import SlotCache
from eyas.target.layout import TargetLayout
from eyas.target.taps import Taps

SUPPORTED = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}


def fused_support(model: nn.Module, layout: TargetLayout) -> str | None:
    """None when the fused forward serves ``model``; otherwise why not (for the log)."""
    for layer in layout.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attention).__name__ not in SUPPORTED:
            return f"attention {type(attention).__name__} is not one of {sorted(SUPPORTED)}"
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"MLP {type(mlp).__name__} is not a gated (gate/up/down) MLP"
        if any(getattr(m, "bias", None) is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "MLP projections with biases"
    if _rotary(model, layout) is None:
        return "no rotary embedding module beside the decoder layers"
    return None


def _rotary(model: nn.Module, layout: TargetLayout) -> nn.Module | None:
    parent = model.get_submodule(layout.layers_path.rpartition(".")[0]) if "." in layout.layers_path else model
    return getattr(parent, "rotary_emb", None)


def _fuse(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) along the output dim; the modules then hold views of them."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("some projections have biases and others not")
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class FusedLlamaForward:
    """``forward(ids [1, n], positions [1, n], mask [1, 1, n, visible], slots [n], aux) → logits [1, n, V]``,
    writing the states ``taps`` names into ``aux`` [1, capacity, k·H] rows [0, n)."""

    def __init__(self, model: nn.Module, layout: TargetLayout, cache: SlotCache, taps: Taps):
        self.layout, self.cache, self.taps = layout, cache, taps
        self.rotary = _rotary(model, layout)
        self.kernels = kernels_available(layout.embed.weight.device)  # eyas.engine.attention's, on a recent GPU
        self.head = vocab_head(layout.lm_head)  # on a CPU, its weight prepacked for oneDNN
        self.layers = []
        for layer in layout.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias = _fuse([attention.q_proj, attention.k_proj, attention.v_proj])
            gate_up_weight, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append((layer, qkv_weight, qkv_bias, gate_up_weight))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                aux: torch.Tensor) -> torch.Tensor:
        hidden = self.layout.embed(ids)
        cos, sin = self.rotary(hidden, positions)
        filled = slots.max().view(1) + 1  # no query sees a slot past the step's own: attention stops there
        for layer_id, (layer, qkv_weight, qkv_bias, gate_up_weight) in enumerate(self.layers):
            self._tap(aux, layer_id, hidden)
            hidden = hidden + self._attention(layer, layer_id, layer.input_layernorm.forward(hidden), qkv_weight,
                                              qkv_bias, cos, sin, mask, slots, filled)
            mlp = layer.mlp
            gate, up = F.linear(layer.post_attention_layernorm.forward(hidden), gate_up_weight).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        self._tap(aux, len(self.layers), hidden)  # layer id N: the final norm's input
        return self.head(self.layout.norm.forward(hidden))

    def _tap(self, aux: torch.Tensor, layer: int, hidden: torch.Tensor) -> None:
        """Copy the residual stream entering decoder ``layer`` into its aux slot, when it is tapped."""
        index = self.taps.entering(layer)
        if index is not None:
            self.taps.view(aux, index)[:, : hidden.shape[1]].copy_(hidden)

    def _attention(self, layer, layer_id, x, qkv_weight, qkv_bias, cos, sin, mask, slots, filled) -> torch.Tensor:
        attention = layer.self_attn
        batch, n, _ = x.shape
        head_dim = attention.head_dim
        heads = attention.q_proj.weight.shape[0] // head_dim
        kv_heads = attention.k_proj.weight.shape[0] // head_dim
        q, k, v = F.linear(x, qkv_weight, qkv_bias).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = (t.view(batch, n, -1, head_dim) for t in (q, k, v))
        if hasattr(attention, "q_norm"):  # Qwen3: per-head RMSNorm of queries and keys before rotation
            q, k = attention.q_norm.forward(q), attention.k_norm.forward(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        keys, values = self.cache.update(k, v.transpose(1, 2), layer_id)  # [1, kv_heads, capacity, d]
        out = attend(q, keys, values, mask, attention.scaling, filled) if self.kernels else None  # split across the cache
        if out is not None:
            return attention.o_proj(out)
        group = heads // kv_heads
        if group > 1:  # as HF does: each key head repeated for its query heads (the same attention kernel runs)
            keys = keys[:, :, None].expand(batch, kv_heads, group, *keys.shape[2:]).reshape(batch, heads, *keys.shape[2:])
            values = values[:, :, None].expand(batch, kv_heads, group, *values.shape[2:]).reshape(batch, heads, *values.shape[2:])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attention.scaling)
        out = out.transpose(1, 2).reshape(batch, n, heads * head_dim)
        return attention.o_proj(out)
