"""The DSpark drafter: a block backbone proposes a whole block in one forward, and a Markov head makes each proposal
depend on the one before it (the third drafter family; deepseek-ai/DeepSpec, the DSpark paper).

Layout (what vLLM 0.32 loads as ``Qwen3DSparkModel``, model_executor/models/qwen3_dspark.py): DFlash's backbone
(:class:`eyas.families.dflash.model.DFlashDrafter`: fc + hidden_norm over the target's tapped states — the context —,
Qwen3 layers whose keys are the context's then the block's own, the final norm; the target's embedding and lm_head
shared, never owned), and

    markov_head.markov_w1: Embedding(V, r) — the previous token's Markov embedding
    markov_head.markov_w2: Linear(r → V, no bias) — its bias over the vocabulary

The block anchored at position a holds [anchor token, mask × (B − 1)] at positions a … a + B − 1 and sees the context
at positions < a and the whole block (no causal mask inside it), as DFlash's does. Unlike DFlash's, every slot is a
prediction — slot j proposes the token at a + j + 1 (vLLM's ``sample_from_anchor`` layout) — so a block proposes B
tokens. Slot j's logits are the backbone's plus the Markov bias of the token before it:

    logits_j = lm_head(h_j) + markov_w2 · markov_w1[x_j],   x_0 = the anchor token, x_j = slot j − 1's proposal

Drafting is one parallel forward, then a sequential pass over the slots that costs a row lookup and an r × V product
each (:func:`propose`). Training feeds the sequence's own tokens as x_j (teacher forcing, as DeepSpec does): wherever a
chain's drafts so far are right, they are what drafting feeds, so training computes the logits drafting computes for
every slot a verification reaches (tests/test_dspark.py pins them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.families.dflash.model import DFlashDrafter, accepted_runs, batch_training_mask, block_anchors, block_input
from eyas.families.dflash.model import slot_weights as dflash_slot_weights
from eyas.families.dspark.config import DSparkConfig


class MarkovHead(nn.Module):
    """The bias each proposal's logits get from the token before it: markov_w2 · markov_w1[token]. markov_w2 starts at
    zero: a new drafter is its backbone alone."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        """Token ids [...] → the bias over the vocabulary [..., V]."""
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    """The chance that a slot's draft is accepted, as a logit: ``proj`` of the slot's final-normed state and the Markov
    embedding of the token before it, concatenated (vLLM's DSparkConfidenceHead with ``confidence_head_with_markov``;
    DeepSpec's AcceptRatePredictor), in float32."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """[..., H] and [..., r] → logits [...]."""
        return F.linear(torch.cat([hidden, markov_embed], -1).float(), self.proj.weight.float(),
                        self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DFlash's backbone (fc, hidden_norm, layers, norm), the Markov head and, when its config asks, the confidence
    head; the target's embedding and lm_head are passed in where needed."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size, config.markov_rank) if config.confidence_head else None

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit [...] that the draft of slots ``hidden`` [..., H] after tokens ``previous`` [...]
        is accepted (its sigmoid: the chance)."""
        return self.confidence_head(hidden, self.markov_head.markov_w1(previous))

    def slot_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of slots whose final-normed states are ``hidden`` [..., H], each after token ``previous``
        [...]: the backbone's through the target's ``lm_head`` weight, plus the Markov bias."""
        return F.linear(hidden, lm_head.to(hidden.dtype)) + self.markov_head(previous)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Its vocabulary is the target's: an id is a target id."""
        return ids


def spark_block_hidden(drafter: DSparkDrafter, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                       embed: torch.Tensor) -> torch.Tensor:
    """Every block of a batch in one forward: features [R, T, A·Ht], input_ids [R, T], anchors [R, n] → the blocks'
    final-normed states [R, n, B, H] (block i of row r anchored at anchors[r, i], seeing the context before it)."""
    config = drafter.config
    block = config.block_size
    rows, length = input_ids.shape
    count = anchors.shape[1]
    context = drafter.context(features)
    context_kv = drafter.context_kv(context, torch.arange(length, device=input_ids.device).expand(rows, length))
    tokens = block_input(input_ids.gather(1, anchors), block, config.mask_token_id).view(rows, count * block)
    positions = (anchors[..., None] + torch.arange(block, device=input_ids.device)).view(rows, count * block)
    mask = batch_training_mask(anchors, length, block)
    hidden = drafter.block_hidden(F.embedding(tokens, embed).to(context.dtype), positions, context_kv, mask)
    return hidden.view(rows, count, block, -1)


# A DSpark block of B anchored at a predicts the tokens at a + 1 … a + B: the places a DFlash block of B + 1 anchored
# at a predicts, slot j as DFlash's slot j + 1. Where the anchors may stand and how the slots' losses decay are
# therefore DFlash's rules for a block of B + 1.

def draw_anchors(loss_mask: torch.Tensor, valid: torch.Tensor, block_size: int, count: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` anchors per row of a batch [R, T] for blocks of ``block_size`` → (anchors [R, count], usable [R, count]):
    a usable anchor a ≥ 1 has its first proposal's token trained (loss_mask[a + 1]) and every token it proposes inside
    the row (a + B < the row's length); :func:`eyas.families.dflash.model.block_anchors` for a block of B + 1."""
    return block_anchors(loss_mask, valid, block_size + 1, count, generator)


def slot_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """Slot j's weight in the loss (j = 0 … B − 1): exp(−j/γ), DeepSpec's decay (a chain is accepted from its first
    draft on); all 1 without γ — :func:`eyas.families.dflash.model.slot_weights` for a block of B + 1."""
    return dflash_slot_weights(block_size + 1, gamma, device)


def slot_places(trained: torch.Tensor, anchors: torch.Tensor, usable: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the slots of blocks at ``anchors`` [R, n] stand in rows [R, T] → (positions [R, n, B], clamped into the
    row: slot j at a + j predicts the token at a + j + 1; counted [R, n, B]: the slot is learned from — its block is
    usable and the tokens it and every slot before it predict are trained, DeepSpec's contiguous prefix)."""
    length = trained.shape[1]
    at = (anchors[..., None] + torch.arange(block_size, device=anchors.device)).clamp(max=length - 1)
    predicted = trained.gather(1, (at + 1).clamp(max=length - 1).flatten(1)).view_as(at)
    counted = (predicted & usable[..., None]).long().cumprod(-1).bool()
    return at, counted


def slot_weight_total(trained: torch.Tensor, anchors: torch.Tensor, usable: torch.Tensor, weights: torch.Tensor
                      ) -> torch.Tensor:
    """Σ w_j over the counted slots of blocks at ``anchors``: the loss's denominator (no forward needed)."""
    _, counted = slot_places(trained, anchors, usable, weights.shape[0])
    return (counted.float() * weights.to(counted.device)).sum()


@dataclass
class SparkStats:
    """One batch's blocks scored, every number on the device: the loss and each slot's share of it, hits and counted
    slots per slot [B]; over the blocks whose every slot is counted, the drafts a greedy chain verification accepts
    (summed), the expected drafts a chain drawn at temperature 1 gets accepted (Σ_k Π_{j ≤ k} (1 − ½·L1_j), summed),
    how many such blocks, and how many of them accept at least k + 1 greedy drafts [B]."""

    loss: torch.Tensor
    shares: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    accepted: torch.Tensor
    drawn_accepted: torch.Tensor
    blocks: torch.Tensor
    depth_counts: torch.Tensor


# The loss's full-vocabulary part runs over this many slots at a time, each chunk recomputed in the backward pass
# (activation checkpointing): the drafter's and the target's distributions over V tokens are held for one chunk only,
# not for every slot of a pass — 4,096 × 49,152 floats is 0.8 GB where a pass of 32,768 slots would hold 6.4 GB a
# tensor, several of them (at a Kimi-class vocabulary of 163,840: 2.7 GB against 21 GB).
LOSS_ROWS = 4096


def _slot_terms(drafter: DSparkDrafter, lm_head: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
                teacher: torch.Tensor, weight: torch.Tensor, l1_share: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots [k, H] after tokens [k] against the target's final states there [k, Ht], weighted [k] → (each slot's
    weighted loss [k], whether its argmax is the target's greedy token [k], its L1 distance to the target's
    distribution [k]; the last two carry no gradient)."""
    logits = drafter.slot_logits(hidden, lm_head, previous).float()
    with torch.no_grad():
        target = F.linear(teacher.to(lm_head.dtype), lm_head).float()
        expected = target.argmax(-1)
        target = target.softmax(-1)
    ce = F.cross_entropy(logits, expected, reduction="none")
    l1 = (logits.softmax(-1) - target).abs().sum(-1)
    each = (1.0 - l1_share) * ce + l1_share * l1
    if drafter.confidence_head is not None:  # DeepSpec's: BCE against the chance a drawn draft is accepted, 1 − ½·L1
        chance = (1.0 - 0.5 * l1.detach()).clamp(0, 1)
        each = each + F.binary_cross_entropy_with_logits(drafter.confidence(hidden, previous), chance, reduction="none")
    right = logits.detach().argmax(-1) == expected
    return each * weight, right, l1.detach()


def spark_loss(drafter: DSparkDrafter, features: torch.Tensor, input_ids: torch.Tensor, final: torch.Tensor,
               trained: torch.Tensor, anchors: torch.Tensor, usable: torch.Tensor, embed: torch.Tensor,
               lm_head: torch.Tensor, weights: torch.Tensor, l1_share: float,
               normalizer: torch.Tensor | None = None, chunk_rows: int = LOSS_ROWS) -> SparkStats:
    """The blocks of a batch in one forward: features [R, T, A·Ht], input_ids [R, T], the target's final states
    [R, T, Ht] (its logits: lm_head(final)), trained (bool) [R, T], anchors and usable [R, n] (:func:`draw_anchors`),
    the target's embedding and lm_head weights, slot weights [B] (:func:`slot_weights`).

    Slot j of the block at a predicts the token at a + j + 1, after x_j = input_ids[a + j] (teacher forcing). Against
    the target's distribution there, p = softmax(lm_head(final[a + j])), and its greedy token argmax p, slot j's loss is
    (1 − ``l1_share``)·CE(logits_j, argmax p) + ``l1_share``·‖softmax(logits_j) − p‖₁ — DeepSpec's objective; the L1
    term is twice the chance that a draft drawn from the drafter at temperature 1 is rejected. A drafter with a
    confidence head adds its binary cross-entropy against that acceptance chance, 1 − ½·L1 (DeepSpec's, weight 1;
    its gradient reaches the backbone and the Markov embedding, as there). The loss is the
    weighted mean over counted slots, Σ w_j·loss_j / Σ w_j; ``normalizer``: the Σ w_j of every block this forward is a
    part of (:func:`slot_weight_total`), so that parts add up to the whole. The full-vocabulary part runs
    ``chunk_rows`` slots at a time, checkpointed (:data:`LOSS_ROWS`): the same loss and gradients, bounded memory."""
    from torch.utils.checkpoint import checkpoint

    block = drafter.config.block_size
    rows, count = anchors.shape
    hidden = spark_block_hidden(drafter, features, input_ids, anchors, embed).flatten(0, 2)
    at, counted = slot_places(trained, anchors, usable, block)
    previous = input_ids.gather(1, at.flatten(1)).flatten()
    teacher = final[torch.arange(rows, device=at.device)[:, None], at.flatten(1)].flatten(0, 1)
    weighted = (counted.float() * weights.to(counted.device)).flatten()
    parts = [checkpoint(_slot_terms, drafter, lm_head, hidden[i : i + chunk_rows], previous[i : i + chunk_rows],
                        teacher[i : i + chunk_rows], weighted[i : i + chunk_rows], l1_share, use_reentrant=False)
             for i in range(0, hidden.shape[0], chunk_rows)]
    each, right, l1 = (torch.cat(part).view(rows, count, block) for part in zip(*parts, strict=True))
    total = (weighted.sum() if normalizer is None else normalizer).clamp_min(1e-9)
    per_slot = each.sum((0, 1)) / total  # each slot's share: they sum to the loss
    loss = per_slot.sum()
    with torch.no_grad():
        right = right & counted
        whole = counted.all(-1)
        runs = accepted_runs(right)[whole]
        drawn = (1.0 - 0.5 * l1).clamp(0, 1).cumprod(-1).sum(-1)[whole]
        depth = torch.arange(block, device=runs.device)
        return SparkStats(loss=loss, shares=per_slot.detach(), correct=right.sum((0, 1)).float(),
                          counted=counted.sum((0, 1)).float(), accepted=runs.sum().float(),
                          drawn_accepted=drawn.sum().float(), blocks=whole.sum().float(),
                          depth_counts=(runs[:, None] > depth).sum(0).float())


@torch.no_grad()
def propose(drafter: DSparkDrafter, context_kv: list[tuple[torch.Tensor, torch.Tensor]], anchor_token: int,
            anchor_position: int, embed: nn.Module, lm_head: torch.Tensor, previous: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafting from scratch: the block at ``anchor_position`` over a cached context (the positions before it) → (its
    B greedy proposals, each slot's logits [B, V]). Each slot's Markov bias follows the proposal before it, or
    ``previous[j]`` where given (x_j: the token before slot j; ``previous[0]`` is the anchor's)."""
    config = drafter.config
    device = lm_head.device
    tokens = block_input(torch.tensor([anchor_token], device=device), config.block_size, config.mask_token_id)
    positions = anchor_position + torch.arange(config.block_size, device=device)[None]
    hidden = drafter.block_hidden(F.embedding(tokens, embed.weight), positions, context_kv, None)[0]
    token = torch.tensor(anchor_token, device=device)
    proposals, rows = [], []
    for j in range(config.block_size):
        before = token if previous is None else torch.tensor(previous[j], device=device)
        row = drafter.slot_logits(hidden[j], lm_head, before)
        token = row.argmax(-1)
        proposals.append(token)
        rows.append(row)
    return torch.stack(proposals), torch.stack(rows)
