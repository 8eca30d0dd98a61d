"""EAGLE-3's part of the predicted τ (:mod:`eyas.train.prediction`): the chance that each draft of a chain is kept,
along the target's own answers, from the drafter's training-time test.

TTT step k at position j drafts the token at j + 2 + k after steps 0 … k−1 drafted the tokens before it — the
sequence's own tokens, which is what they were if they were kept: exactly the drafter's state in the engine when a
round starts after the answer's first j − P + 2 tokens (prompt of P tokens) and has kept k drafts. The draft is kept
when it is the answer's token there (T = 0: the drafter's argmax), or, drawn at T, with probability
min(p(x), q(x)) / p(x) for the answer's token x (the module note of :mod:`eyas.train.prediction`).
"""

from __future__ import annotations

import numpy as np
import torch

from eyas.families.eagle3.ttt import shift_left, ttt_steps
from eyas.sampling import sampling_probs


def next_token_probability(final: torch.Tensor, head: torch.Tensor, input_ids: torch.Tensor, temperature: float,
                           top_p: float, chunk_tokens: int = 1024) -> torch.Tensor:
    """p(token j + 1) under the target's sampling distribution at position j [B, T] (0 at the last position), from its
    final states [B, T, Ht] and lm_head [V, Ht], a chunk of tokens at a time (never a [T, V] float32 tensor whole)."""
    flat = final.reshape(-1, final.shape[-1]).to(head.dtype)
    following = shift_left(input_ids, 1).reshape(-1, 1)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=final.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        probs = sampling_probs(flat[start:start + chunk_tokens] @ head.T, temperature, top_p)
        out[start:start + chunk_tokens] = probs.gather(1, following[start:start + chunk_tokens])[:, 0]
    return out.view(input_ids.shape)


@torch.no_grad()
def kept_chances(drafter, batch, head: torch.Tensor, draft_ids: torch.Tensor, depth: int,
                 temperatures: tuple[float, ...], top_p: float, autocast) -> dict[float, torch.Tensor]:
    """Per temperature, [B, T, depth]: the chance TTT step k's draft at position j is kept (module docstring); past a
    row's end, 0."""
    ids = batch.input_ids
    vocab = head.shape[0]
    draft_index = torch.full((vocab,), -1, dtype=torch.long, device=ids.device)  # a target id's draft id, −1: none
    draft_index[draft_ids] = torch.arange(len(draft_ids), device=ids.device)
    target_p = {t: next_token_probability(batch.final, head, ids, t, top_p) for t in temperatures if t > 0}
    chances = {t: torch.zeros(*ids.shape, depth, device=ids.device) for t in temperatures}
    with autocast():
        steps = ttt_steps(drafter, batch.aux, ids, depth)
        for k, logits in enumerate(steps):
            answer = shift_left(ids, 2 + k)  # the token the draft at j is judged against
            inside = shift_left(batch.valid, 2 + k, fill=False)
            index = draft_index[answer]
            for t in temperatures:
                if t <= 0:
                    kept = (draft_ids[logits.argmax(-1)] == answer).float()
                else:
                    q = sampling_probs(logits, t).gather(-1, index.clamp(min=0).unsqueeze(-1))[..., 0]
                    p = shift_left(target_p[t], 1 + k)
                    kept = torch.where((index >= 0) & (p > 0), torch.clamp(q / p.clamp(min=1e-30), max=1.0), 0.0)
                chances[t][..., k] = torch.where(inside, kept, 0.0)
    return chances


def predict(drafter, prediction, head: torch.Tensor, draft_ids: torch.Tensor, autocast) -> list[dict]:
    """The τ rows of :func:`eyas.train.prediction.predicted_tau` for ``drafter`` on ``prediction``'s answers."""
    from eyas.train.prediction import predicted_tau

    was_training = drafter.training
    drafter.eval()
    depth = max(prediction.depths)
    answered = prediction.by_key()
    temperatures = tuple(sorted({a.temperature for a in prediction.answered}))
    per_answer: dict[str, np.ndarray] = {}
    source = prediction.source
    for b in range(len(source.batches)):
        batch = source.batch(b)
        chances = kept_chances(drafter, batch, head, draft_ids, depth, temperatures, prediction.top_p, autocast)
        for row, i in enumerate(source.batches[b]):
            a = answered[source.samples[i].id]
            # row n: the round that starts after n emitted tokens, at position P + n − 2 (n = 1: the prompt's last);
            # rounds start while fewer than the limit are out (the tokens past it are only judged against)
            first = len(a.prompt) - 1
            rows = chances[a.temperature][row, first : first + a.limit - 1].float().cpu().numpy()
            per_answer[a.key] = np.concatenate([np.zeros((1, depth)), rows])
    drafter.train(was_training)
    return predicted_tau(prediction, per_answer)
