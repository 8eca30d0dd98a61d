"""The DFlash block drafter: one forward proposes a whole block of tokens (the second drafter family).

Layout (what vLLM 0.32 loads as ``DFlashDraftModel``, model_executor/models/qwen3_dflash.py; the published
DFlash recipe's model); the parameter names are the checkpoint names vLLM's loader reads:

    fc: A·Ht → H (no bias) on the target's states at the A tapped layer ids, concatenated; hidden_norm on its
        output: the *context*, one row per position the target has processed
    layers.i: Qwen3 decoder layers (per-head q_norm / k_norm, SwiGLU). A layer's keys and values are those of the
        context (k/v_proj straight on it, no input norm; k_norm and RoPE at the context's positions) followed by
        those of the block's own hidden states
    norm → the target's lm_head; the block's input is the target's embedding of [anchor token, mask × (B − 1)]
        (both frozen and shared: the drafter owns neither) — the table's rows as they are, as vLLM reads them (a
        scaled embedding's factor, Gemma's √H, is not applied), in training and drafting alike

A block anchored at position a (its first token is the one at a, whose target states are not known yet) sees the
context at positions < a and the whole block, without a causal mask inside it; blocks never see each other. Its
slots 1 … B − 1 propose the tokens at a + 1 … a + B − 1, all in one forward.

Training (many blocks per sequence, one forward) and drafting (one block over a cached context) run the same
:meth:`DFlashDrafter.block_hidden`; only which keys are present differs, and tests/test_dflash.py pins the two
equal. Layer ids are eyas ids (DESIGN: id L = the residual stream entering decoder layer L); DFlash's own
configs count "the output of layer i", which is eyas id i + 1 (:func:`eyas.families.dflash.config.dflash_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from eyas.families.dflash.config import DFlashConfig


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

    owns_embedding = False  # the block's input embedding and the lm_head are the target's

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())

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
    return batch_training_mask(anchors[None], context_length, block_size)[0, 0]


def batch_training_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """:func:`training_mask` of each row of ``anchors`` [R, n] → [R, 1, n·B, T + n·B]."""
    rows, count = anchors.shape
    context = torch.arange(context_length, device=anchors.device) < anchors[..., None]  # [R, n, T]
    own = torch.eye(count, dtype=torch.bool, device=anchors.device)  # block j's rows see block j's keys only
    own = own.repeat_interleave(block_size, dim=1).expand(rows, count, count * block_size)
    return torch.cat([context, own], dim=-1).repeat_interleave(block_size, dim=1)[:, None]


def block_anchors(loss_mask: torch.Tensor, valid: torch.Tensor, block_size: int, count: int,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` anchor positions per row of a batch [R, T], drawn on its device without replacement → (anchors
    [R, count], usable [R, count]). An anchor a ≥ 1 is usable when its next token is trained (loss_mask[a + 1]) and its
    whole block lies in the row (a + B ≤ the row's length); a row with fewer such places fills up with unusable ones."""
    rows, length = loss_mask.shape
    place = torch.arange(length, device=loss_mask.device)
    trained_next = F.pad(loss_mask[:, 1:] > 0, (0, 1), value=False)
    allowed = trained_next & (place >= 1) & (place + block_size <= valid.sum(1, keepdim=True))
    scores = torch.rand(rows, length, generator=generator, device=loss_mask.device)
    scores = torch.where(allowed, scores, -1.0)
    best, anchors = scores.topk(min(count, length), dim=1)
    return anchors, best >= 0


def sample_anchors(loss_mask: torch.Tensor, block_size: int, count: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Up to ``count`` distinct usable anchors of one sequence (:func:`block_anchors`), sorted."""
    anchors, usable = block_anchors(loss_mask[None], torch.ones_like(loss_mask, dtype=torch.bool)[None], block_size,
                                    count, generator)
    return anchors[usable].sort().values


def teacher_tokens(final: torch.Tensor, lm_head: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """The token the target emits at each position [R, T] (the greedy choice after position p − 1, from its final
    hidden state; position 0: 0): what a greedy verification accepts a draft against. Full-vocabulary logits one
    chunk of positions at a time, never all at once."""
    rows, length, width = final.shape
    flat = final.reshape(-1, width).to(lm_head.dtype)
    with torch.no_grad():
        chosen = torch.cat([(flat[i:i + chunk_tokens] @ lm_head.T).argmax(-1)
                            for i in range(0, flat.shape[0], chunk_tokens)]).view(rows, length)
    return F.pad(chosen[:, :-1], (1, 0))


def slot_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """Slot k's weight in the loss (k = 1 … B − 1): exp(−(k − 1)/γ), the published decay (early slots matter most:
    a chain is accepted from its first draft on); all 1 without γ."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.ones_like(k) if gamma is None else torch.exp(-(k - 1) / gamma)


@dataclass
class BlockStats:
    """One batch's blocks scored, every number on the device: the loss, each slot's share of it, hits and trained
    slots per slot [B − 1], and for the blocks whose every slot is trained (what verification would see) the drafts
    a greedy chain verification accepts, summed, and how many such blocks."""

    loss: torch.Tensor
    shares: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    accepted: torch.Tensor
    blocks: torch.Tensor
    depth_counts: torch.Tensor  # [B − 1]: whole blocks whose first k + 1 drafts are all right


def accepted_runs(right: torch.Tensor) -> torch.Tensor:
    """[..., B − 1] slot hits → [...] drafts a greedy chain verification accepts: the run of hits from the first slot."""
    return right.long().cumprod(dim=-1).sum(dim=-1)


def slot_places(trained: torch.Tensor, anchors: torch.Tensor, usable: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the mask slots of blocks at ``anchors`` [R, n] land in rows [R, T] → (positions [R, n·(B − 1)], clamped
    into the row; counted [R, n, B − 1]: the slot is trained — its position is, and its block is usable)."""
    rows, length = trained.shape
    offsets = torch.arange(1, block_size, device=anchors.device)
    at = (anchors[..., None] + offsets).clamp(max=length - 1).view(rows, -1)
    counted = trained.gather(1, at).view(rows, anchors.shape[1], block_size - 1) & usable[..., None]
    return at, counted


def slot_weight_total(trained: torch.Tensor, anchors: torch.Tensor, usable: torch.Tensor, weights: torch.Tensor
                      ) -> torch.Tensor:
    """Σ w_k over the trained slots of blocks at ``anchors``: the loss's denominator (no forward needed)."""
    _, counted = slot_places(trained, anchors, usable, weights.shape[0] + 1)
    return (counted.float() * weights.to(counted.device)).sum()


def block_loss(drafter: DFlashDrafter, features: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
               trained: torch.Tensor, anchors: torch.Tensor, usable: torch.Tensor, embed: torch.Tensor,
               lm_head: torch.Tensor, weights: torch.Tensor, normalizer: torch.Tensor | None = None) -> BlockStats:
    """Every block of a batch in one forward: features [R, T, A·Ht], input_ids, labels (the token expected at each
    position) and trained (bool) [R, T], anchors and usable [R, n] (:func:`block_anchors`), the target's embedding and
    lm_head weights, slot weights [B − 1] (:func:`slot_weights`).

    Slot k of the block at a is trained to predict labels[a + k] where that position is trained; the loss is the
    weighted mean cross-entropy over trained slots, Σ w_k·CE / Σ w_k (the published objective). ``normalizer``: the
    Σ w_k of all the blocks this forward is a part of (:func:`slot_weight_total`), so that the parts' losses add up to
    the whole's; by default this forward's own."""
    config = drafter.config
    block = config.block_size
    rows, length = input_ids.shape
    count = anchors.shape[1]
    context = drafter.context(features)
    context_kv = drafter.context_kv(context, torch.arange(length, device=input_ids.device).expand(rows, length))
    tokens = block_input(input_ids.gather(1, anchors), block, config.mask_token_id).view(rows, count * block)
    offsets = torch.arange(block, device=input_ids.device)
    positions = (anchors[..., None] + offsets).view(rows, count * block)
    mask = batch_training_mask(anchors, length, block)
    hidden = drafter.block_hidden(F.embedding(tokens, embed).to(context.dtype), positions, context_kv, mask)
    hidden = hidden.view(rows, count, block, -1)[:, :, 1:]  # the mask slots [R, n, B − 1, H]
    at, counted = slot_places(trained, anchors, usable, block)
    expected = labels.gather(1, at).view(rows, count, block - 1)
    logits = F.linear(hidden, lm_head.to(hidden.dtype)).float()
    each = F.cross_entropy(logits.flatten(0, 2), expected.flatten(), reduction="none").view_as(expected)
    weighted = counted.float() * weights.to(each.device)
    total = (weighted.sum() if normalizer is None else normalizer).clamp_min(1e-9)
    per_slot = (each * weighted).sum((0, 1)) / total  # each slot's share: they sum to the loss
    right = (logits.argmax(-1) == expected) & counted
    whole = counted.all(-1)
    runs = accepted_runs(right)[whole]
    depth = torch.arange(block - 1, device=runs.device)
    return BlockStats(loss=per_slot.sum(), shares=per_slot.detach(), correct=right.sum((0, 1)).float(),
                      counted=counted.sum((0, 1)).float(), accepted=runs.sum().float(), blocks=whole.sum().float(),
                      depth_counts=(runs[:, None] > depth).sum(0).float())


@dataclass
class BlockLoss:
    loss: torch.Tensor  # weighted mean cross-entropy over the trained block slots
    accuracy: list[float]  # per block slot 1 … B − 1: share of trained slots whose argmax is the label
    slots: int  # trained slots counted
    tau: float  # simulated τ: 1 + the mean run of right slots from slot 1, over blocks whose every slot is trained


def dflash_loss(drafter: DFlashDrafter, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                anchors: torch.Tensor, embed: nn.Module, lm_head: torch.Tensor, gamma: float | None = None) -> BlockLoss:
    """:func:`block_loss` of one sequence — features [T, A·Ht], input_ids and loss_mask [T], anchors [n] — whose
    labels are its own tokens, read back to the host."""
    stats = block_loss(drafter, features[None], input_ids[None], input_ids[None], loss_mask[None].bool(), anchors[None],
                       torch.ones_like(anchors, dtype=torch.bool)[None], embed.weight, lm_head,
                       slot_weights(drafter.config.block_size, gamma, input_ids.device))
    tau = 1.0 + float(stats.accepted / stats.blocks) if stats.blocks > 0 else 1.0
    return BlockLoss(loss=stats.loss, accuracy=(stats.correct / stats.counted.clamp_min(1)).tolist(),
                     slots=int(stats.counted.sum()), tau=tau)


@torch.no_grad()
def propose(drafter: DFlashDrafter, context_kv: list[tuple[torch.Tensor, torch.Tensor]], anchor_token: int,
            anchor_position: int, embed: nn.Module, lm_head: torch.Tensor) -> torch.Tensor:
    """Drafting: the block at ``anchor_position`` over a cached context (the positions before it) → its B − 1
    proposals, argmax per slot (greedy), in one forward."""
    config = drafter.config
    device = lm_head.device
    tokens = block_input(torch.tensor([anchor_token], device=device), config.block_size, config.mask_token_id)
    positions = anchor_position + torch.arange(config.block_size, device=device)[None]
    hidden = drafter.block_hidden(F.embedding(tokens, embed.weight), positions, context_kv, None)
    return F.linear(hidden[0, 1:], lm_head).argmax(-1)
