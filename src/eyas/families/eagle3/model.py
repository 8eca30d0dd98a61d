"""The EAGLE-3 drafter module. Parameter names are the export names (DESIGN: "Drafter", "Export contract").

    fc: 3·Ht → H (no bias) on concat(low, mid, high) target states
    midlayer: input_layernorm(token embedding) ‖ hidden_norm(hidden) → q/k/v (2H wide) → attention
              → o_proj + residual (the un-normed hidden) → post_attention_layernorm → SwiGLU MLP + residual
    norm → lm_head: H → Vd
The layer's pre-norm output is the next step's hidden. The token embedding is the target's, frozen
(the drafter only owns one when its width differs from the target's).

EAGLE-3.1 (config ``fc_norm``, ``norm_output``; vLLM's and SGLang's names and arithmetic) adds an RMSNorm on each
target state before fc (``fc_norm.{i}``, Ht wide) and passes the post-norm output on instead of the pre-norm one. The
state a drafting step hands on is :meth:`Eagle3Drafter.layer`'s result either way; :meth:`Eagle3Drafter.head_input`
turns it into what ``lm_head`` reads.

Attention itself is passed in as a function, because training (training-time test) and drafting
(a KV cache) see different keys; everything else is shared, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eyas.families.eagle3.config import DrafterConfig

# attend(q [B, h, n, d], k_new [B, h, n, d], v_new [B, h, n, d]) → [B, h, n, d]; key/value heads already expanded
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FusedProjections(NamedTuple):
    """Decoding's projections as one matmul each: q/k/v's weights concatenated, gate/up's concatenated."""

    qkv: torch.Tensor
    gate_up: torch.Tensor


class DrafterAttention(nn.Module):
    """q/k/v read 2H (normed embedding ‖ normed hidden); o_proj writes H."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                qkv_weight: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        if qkv_weight is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # decoding: q/k/v's weights concatenated (FusedProjections), one matmul
            widths = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
            q, k, v = F.linear(x, qkv_weight).split(widths, dim=-1)
        q = q.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, self.heads * self.head_dim))


class DrafterLayer(nn.Module):
    """The single decoder layer (exported as ``midlayer.*``)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        llama = config.llama_config()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def forward(self, embeds, hidden, cos, sin, attend: Attend, fused: FusedProjections | None = None) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden  # eyas' own drafters: the un-normed hidden
        hidden = residual + self.self_attn(x, cos, sin, attend, None if fused is None else fused.qkv)
        x = self.post_attention_layernorm(hidden)
        if fused is None:
            return hidden + self.mlp(x)
        gate, up = F.linear(x, fused.gate_up).chunk(2, dim=-1)
        return hidden + self.mlp.down_proj(self.mlp.act_fn(gate) * up)


class Eagle3Drafter(nn.Module):
    """fc + one layer + norm + lm_head over the draft vocabulary, with the target's frozen embedding."""

    def __init__(self, config: DrafterConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(config.aux_width, config.hidden_size, bias=False)
        if config.fc_norm:  # EAGLE-3.1: one norm per target state
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                                         for _ in config.layer_ids)
        self.midlayer = DrafterLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config.llama_config())
        if d2t is None:
            d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        if len(d2t) != config.draft_vocab_size:
            raise ValueError(f"d2t has {len(d2t)} entries for a draft vocabulary of {config.draft_vocab_size}")
        self.register_buffer("d2t", d2t.to(torch.int64), persistent=False)
        self.embed_tokens.weight.requires_grad_(config.hidden_size != config.target_hidden_size)

    @property
    def owns_embedding(self) -> bool:
        """True when H ≠ Ht: the target's embedding cannot be used, the drafter trains its own."""
        return self.config.hidden_size != self.config.target_hidden_size

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's token embedding in (frozen) when the widths match."""
        if self.owns_embedding:
            return
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The first step's hidden from the target states [..., k·Ht] (concat low → high): fc, after each state's own
        norm under EAGLE-3.1's ``fc_norm``."""
        if self.config.fc_norm:
            aux = torch.cat([norm(state) for norm, state in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1),
                                                                strict=True)], dim=-1)
        return self.fc(aux)

    def layer(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
              fused: FusedProjections | None = None) -> torch.Tensor:
        """One pass of the layer: returns the next step's hidden (the pre-norm output; the post-norm one under
        EAGLE-3.1's ``norm_output``). ``fused`` (:meth:`fused_projections`, decoding): the same arithmetic with two
        matmuls fewer."""
        embeds = self.embed_tokens(token_ids).to(hidden.dtype)
        cos, sin = self.rotary(hidden, positions)
        out = self.midlayer(embeds, hidden, cos, sin, attend, fused)
        # the norm's fp32 weight under training's autocast would widen it: the next step gets the layer's precision
        return self.norm(out).to(out.dtype) if self.config.norm_output else out

    def fused_projections(self) -> FusedProjections | None:
        """For decoding: copies of q/k/v's weights concatenated and of gate/up's (a snapshot of the current
        weights), or None when a projection has a bias."""
        attention, mlp = self.midlayer.self_attn, self.midlayer.mlp
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj)
        if any(m.bias is not None for m in linears):
            return None
        with torch.no_grad():
            return FusedProjections(qkv=torch.cat([m.weight for m in linears[:3]]),
                                    gate_up=torch.cat([m.weight for m in linears[3:]]))

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What ``lm_head`` reads from a step's hidden (:meth:`layer`): its norm, or itself when it is already normed
        (``norm_output``)."""
        return hidden if self.config.norm_output else self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a step's hidden (:meth:`layer`)."""
        return self.lm_head(self.head_input(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: id + d2t[id]."""
        return draft_ids + self.d2t[draft_ids]

    def vocabulary(self) -> torch.Tensor:
        """The target id of each draft-vocabulary entry [Vd], on d2t's device."""
        return self.to_target_ids(torch.arange(len(self.d2t), device=self.d2t.device))

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Everything but the frozen target embedding."""
        return [p for p in self.parameters() if p.requires_grad]
