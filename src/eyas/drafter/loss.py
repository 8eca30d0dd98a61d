"""The EAGLE-3 loss: soft cross-entropy to the target's distribution over the draft vocabulary.

The teacher is the target itself: its logits are ``lm_head(final)``, computed here from the stored
final hidden through the lm_head rows of the draft vocabulary only (in token chunks, never a full
[T, V] float32 tensor), renormalised over the draft vocabulary. A position counts when the token it
predicts is an assistant token (loss mask) and the target's own top choice is in the draft vocabulary
(otherwise no draft could be right there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.drafter.ttt import shift_left


@dataclass
class TargetSignal:
    """The target's view of every position: draft-vocabulary probabilities, top draft id, top-in-draft flag."""

    probs: torch.Tensor  # float32 [B, T, Vd]
    argmax: torch.Tensor  # [B, T] draft ids
    in_draft: torch.Tensor  # [B, T] bool: the target's argmax over the full vocabulary is a draft token


def target_signal(final: torch.Tensor, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor,
                  chunk_tokens: int = 1024) -> TargetSignal:
    """Teacher distributions from ``final`` [B, T, Ht] and the target lm_head weight [V, Ht]."""
    batch, tokens, width = final.shape
    flat = final.reshape(-1, width).to(lm_head_weight.dtype)
    is_draft = torch.zeros(lm_head_weight.shape[0], dtype=torch.bool, device=final.device)
    is_draft[draft_ids] = True
    probs, argmax, in_draft = [], [], []
    with torch.no_grad():
        for start in range(0, flat.shape[0], chunk_tokens):
            # Full-vocabulary logits in the model's dtype, one chunk of tokens at a time: their argmax says
            # whether the target's top token is a draft token, their draft columns are the teacher.
            logits = flat[start:start + chunk_tokens] @ lm_head_weight.T
            draft_logits = logits[:, draft_ids].float()
            probs.append(torch.softmax(draft_logits, dim=-1))
            argmax.append(draft_logits.argmax(-1))
            in_draft.append(is_draft[logits.argmax(-1)])
    return TargetSignal(
        probs=torch.cat(probs).view(batch, tokens, -1),
        argmax=torch.cat(argmax).view(batch, tokens),
        in_draft=torch.cat(in_draft).view(batch, tokens),
    )


@dataclass
class StepResult:
    """Loss (weighted mean) and accuracy counts of one TTT step."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor


def step_loss(logits: torch.Tensor, signal: TargetSignal, loss_mask: torch.Tensor, step: int) -> StepResult:
    """Step ``step``: position i predicts token i+2+step from the target's distribution at i+1+step."""
    shift = 1 + step
    weight = (shift_left(loss_mask, shift + 1) > 0) & shift_left(signal.in_draft, shift, fill=False)
    target = shift_left(signal.probs, shift)
    per_position = -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    w = weight.float()
    count = w.sum()
    loss = (per_position * w).sum() / count.clamp(min=1.0)
    correct = ((logits.argmax(-1) == shift_left(signal.argmax, shift)) & weight).sum()
    return StepResult(loss=loss, correct=correct, count=count)
