"""The DFlash block drafter: one forward proposes a whole block of tokens (the second drafter family).

Layout (what vLLM 0.32 loads as ``DFlashDraftModel``, model_executor/models/qwen3_dflash.py; the published
DFlash recipe's model); the parameter names are the checkpoint names vLLM's loader reads:

    fc: A·Ht → H (no bias) on the target's states at the A tapped layer ids, concatenated; hidden_norm on its
        output: the *context*, one row per position the target has processed
    layers.i: Qwen3 decoder layers (per-head q_norm / k_norm, SwiGLU). A layer's keys and values are those of the
        context (k/v_proj straight on it, no input norm; k_norm and RoPE at the context's positions) followed by
        those of the block's own hidden states
    norm → the target's lm_head; the block's input is the target's embedding of [anchor token, mask × (B − 1)]
        (both frozen and shared: the drafter owns neither)

A block anchored at position a (its first token is the one at a, whose target states are not known yet) sees the
context at positions < a and the whole block, without a causal mask inside it; blocks never see each other. Its
slots 1 … B − 1 propose the tokens at a + 1 … a + B − 1, all in one forward.

Training (many blocks per sequence, one forward) and drafting (one block over a cached context) run the same
:meth:`DFlashDrafter.block_hidden`; only which keys are present differs, and tests/test_dflash.py pins the two
equal. Layer ids are eyas ids (DESIGN: id L = the residual stream entering decoder layer L); DFlash's own
configs count "the output of layer i", which is eyas id i + 1 (:func:`dflash_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half


@dataclass
class DFlashConfig:
    """The drafter's shape; ``layer_ids`` in eyas' meaning, one per tapped target layer."""

    hidden_size: int
    target_hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


def default_dflash_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The published rule (z-lab, SpecForge, SGLang: one tap per draft layer, evenly spaced over outputs 1 … N − 3;
    one draft layer: the middle), in eyas ids. Qwen3-8B (36 layers), 5 draft layers: outputs [1, 9, 17, 25, 33]."""
    if draft_layers == 1:
        outputs = [target_layers // 2]
    else:
        outputs = [round(1 + i * (target_layers - 4) / (draft_layers - 1)) for i in range(draft_layers)]
    return [i + 1 for i in outputs]


def dflash_ids(layer_ids: list[int]) -> list[int]:
    """eyas ids → DFlash's ``target_layer_ids`` (the output of layer i = the input of layer i + 1)."""
    return [i - 1 for i in layer_ids]


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., n, head_dim] for ``positions`` [..., n] (rotate-half, "neox" style, as Qwen3 and vLLM)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, n, d] rotated by cos/sin [B, n, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values [B, kv_heads, n, d] of rows ``x`` [B, n, H]."""
        batch, rows, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, rows, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, rows, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, n, H] (normed block rows) attends to the context's keys and the block's own; ``mask`` [n, T + n]
        (True: may attend), None: every key."""
        batch, rows, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, rows, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """fc + hidden_norm (the context), the decoder layers, the final norm; the target's embedding and lm_head are
    passed in where needed (frozen, never owned)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target states at the tapped ids, concatenated [B, T, A·Ht] → the context rows [B, T, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the context rows at ``positions`` [B, T] (computed once per position when
        drafting: a cache)."""
        cos, sin = rope(positions, self.config.head_dim, self.config.rope_theta, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block_hidden(self, embedded: torch.Tensor, positions: torch.Tensor,
                     context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> torch.Tensor:
        """The final-normed hidden states [B, n, H] of block rows ``embedded`` [B, n, H] at ``positions`` [B, n]."""
        cos, sin = rope(positions, self.config.head_dim, self.config.rope_theta, embedded.dtype)
        x = embedded
        for layer, (k, v) in zip(self.layers, context_kv, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)


def block_input(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Token ids of blocks [..., B]: each anchor token followed by B − 1 mask tokens."""
    masks = anchor_tokens.new_full((*anchor_tokens.shape, block_size - 1), mask_token_id)
    return torch.cat([anchor_tokens[..., None], masks], dim=-1)


def training_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """Which keys each block row may attend to when n blocks run in one forward over one sequence: [n·B, T + n·B],
    True where allowed. A row of block j sees the context at positions < anchors[j] and every row of block j."""
    count = anchors.shape[0]
    context = torch.arange(context_length, device=anchors.device)[None, :] < anchors[:, None]  # [n, T]
    own = torch.eye(count, dtype=torch.bool, device=anchors.device)  # block j's rows see block j's keys only
    rows = torch.cat([context, own.repeat_interleave(block_size, dim=1)], dim=1)  # [n, T + n·B]
    return rows.repeat_interleave(block_size, dim=0)


def sample_anchors(loss_mask: torch.Tensor, block_size: int, count: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Up to ``count`` distinct anchor positions of one sequence, sorted: positions a ≥ 1 whose next token is trained
    (loss_mask[a + 1]) and whose block fits (a + B ≤ T)."""
    length = loss_mask.shape[0]
    allowed = torch.zeros(length, dtype=torch.bool)
    last = length - block_size
    if last >= 1:
        allowed[1: last + 1] = loss_mask[2: last + 2].bool().cpu()
    candidates = allowed.nonzero().flatten()
    if candidates.numel() > count:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
    return candidates.sort().values


@dataclass
class BlockLoss:
    loss: torch.Tensor  # weighted mean cross-entropy over the trained block slots
    accuracy: list[float]  # per block slot 1 … B − 1: share of trained slots whose argmax is the label
    slots: int  # trained slots counted
    tau: float  # simulated τ: 1 + the mean run of right slots from slot 1, over blocks whose every slot is trained


def accepted_runs(right: torch.Tensor) -> torch.Tensor:
    """[n, B − 1] slot hits → [n] drafts a greedy chain verification accepts: the run of hits from the first slot."""
    return right.long().cumprod(dim=-1).sum(dim=-1)


def dflash_loss(drafter: DFlashDrafter, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                anchors: torch.Tensor, embed: nn.Module, lm_head: torch.Tensor, gamma: float | None = None) -> BlockLoss:
    """One sequence's blocks in one forward: features [T, A·Ht], input_ids and loss_mask [T], anchors [n].

    Slot k of the block at a is trained to predict input_ids[a + k] (k = 1 … B − 1) where loss_mask says that token is
    trained, weighted by exp(−(k − 1)/γ) when ``gamma`` is given (the published decay: early slots matter most, a
    chain is accepted from its first draft on)."""
    config = drafter.config
    block = config.block_size
    length = input_ids.shape[0]
    context = drafter.context(features[None])
    context_kv = drafter.context_kv(context, torch.arange(length, device=input_ids.device)[None])
    tokens = block_input(input_ids[anchors], block, config.mask_token_id).flatten()  # [n·B]
    offsets = torch.arange(block, device=input_ids.device)
    positions = (anchors[:, None] + offsets).flatten()
    mask = training_mask(anchors, length, block)
    hidden = drafter.block_hidden(embed(tokens)[None], positions[None], context_kv, mask)[0]
    hidden = hidden.view(len(anchors), block, -1)[:, 1:]  # the mask slots
    labels_at = anchors[:, None] + offsets[1:]  # [n, B − 1]
    weights = loss_mask[labels_at].to(hidden.dtype)
    if gamma is not None:
        weights = weights * torch.exp(-(offsets[1:].to(hidden.dtype) - 1) / gamma)
    logits = F.linear(hidden, lm_head).float()
    labels = input_ids[labels_at]
    each = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(weights)
    trained = loss_mask[labels_at].bool()
    loss = (each * weights).sum() / weights.sum().clamp_min(1e-9)
    right = (logits.argmax(-1) == labels) & trained
    accuracy = (right.sum(0).float() / trained.sum(0).clamp_min(1)).tolist()
    whole = trained.all(dim=-1)  # blocks whose labels are all the target's answer: what verification would see
    tau = 1.0 + accepted_runs(right[whole]).float().mean().item() if whole.any() else 1.0
    return BlockLoss(loss=loss, accuracy=accuracy, slots=int(trained.sum()), tau=tau)


@torch.no_grad()
def propose(drafter: DFlashDrafter, context_kv: list[tuple[torch.Tensor, torch.Tensor]], anchor_token: int,
            anchor_position: int, embed: nn.Module, lm_head: torch.Tensor) -> torch.Tensor:
    """Drafting: the block at ``anchor_position`` over a cached context (the positions before it) → its B − 1
    proposals, argmax per slot (greedy), in one forward."""
    config = drafter.config
    device = lm_head.device
    tokens = block_input(torch.tensor([anchor_token], device=device), config.block_size, config.mask_token_id)
    positions = anchor_position + torch.arange(config.block_size, device=device)[None]
    hidden = drafter.block_hidden(embed(tokens), positions, context_kv, None)
    return F.linear(hidden[0, 1:], lm_head).argmax(-1)
