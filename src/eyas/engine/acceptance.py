"""Which drafted nodes the target accepts, and the token it emits after them (the bonus).

Greedy, the rule: a node is accepted when its parent is and its token is the target's argmax at its
parent; the argmax at the deepest accepted node is the bonus. The output is then the target's own greedy
output, token for token. It runs on the device with no host synchronisation (:func:`tree_verdict`;
:func:`chain_verdict` is the same rule for a chain, in four kernels).

Sampling: drafts here are deterministic (argmax chains, top-k trees), i.e. each candidate was
"proposed with probability 1". The lossless rule for such candidates is the rejection rule with a
one-hot draft distribution: at a node with target distribution p, try its children in order; accept
child c with probability p(c); on rejection set p(c) = 0 and renormalise, then try the next child;
if every child is rejected, sample the bonus token from what is left of p. Child c is emitted with
probability exactly p(c) — (1 − Σ earlier) · p(c) / (1 − Σ earlier) — and anything else with its
own p, so every emitted token follows the target's distribution (a test counts it). The walk runs on
the host (:func:`walk_sampling`), which draws the uniforms from one seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_p filters the target's distribution as transformers does."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T), restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p (the most likely token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def chain_verdict(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy chain's verdict on the device, from ``drafts`` [k] and the target's logits at the root and each
    draft [k + 1, V]: (drafts accepted [1], bonus token [1])."""
    choice = logits.argmax(-1)
    accepted = (choice[:-1] == drafts).long().cumprod(0).sum().view(1)
    return accepted, choice.index_select(0, accepted)


def tree_verdict(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, logits: torch.Tensor,
                 levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy tree's verdict on the device, with no host synchronisation: ``tokens``, ``parents`` (root
    −1), ``depths`` [n] of a tree at most ``levels`` deep and the target's logits at every node [n, V] →
    (drafts accepted [1], bonus token [1], the accepted node at each depth 0 … ``levels`` [levels + 1]; past
    the accepted depth the entries are unspecified). Siblings hold distinct tokens (a dynamic tree's
    children are one top-k), so the accepted nodes form one path."""
    choice = logits.argmax(-1)
    parent_rows = parents.clamp(min=0)
    agrees = (parents < 0) | (tokens == choice.index_select(0, parent_rows))
    accepted_nodes = agrees
    for _ in range(levels):  # one more level settled per pass
        accepted_nodes = agrees & accepted_nodes.index_select(0, parent_rows)
    deepest = torch.where(accepted_nodes, depths, -1).argmax().view(1)
    accepted = depths.index_select(0, deepest)
    # climb from the deepest accepted node: up[i] is its i-th ancestor (the root, once past it)
    up = [deepest]
    for _ in range(levels):
        up.append(parent_rows.index_select(0, up[-1]))
    steps_up = (accepted - torch.arange(levels + 1, device=tokens.device)).clamp(min=0)
    path = torch.cat(up).index_select(0, steps_up)
    return accepted, choice.index_select(0, deepest), path


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` [V] (any device, need not sum to 1): its cumulative sum inverted at a
    uniform drawn from the host ``generator``. The distribution stays where it was computed (on a GPU:
    no [V] logits to the host, no host-side softmax); one number comes back."""
    cumulative = probs.float().cumsum(-1)
    point = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cumulative[-1])
    # the first token whose cumulative mass passes the point: a token of zero mass never is
    index = torch.searchsorted(cumulative, torch.tensor([point], dtype=cumulative.dtype, device=cumulative.device),
                               right=True)
    return min(int(index), probs.shape[-1] - 1)


def child_lists(parents: list[int]) -> list[list[int]]:
    """Every node's children in tree order (best-scored first: nodes are stored by score)."""
    lists: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            lists[parent].append(node)
    return lists


def walk_sampling(tokens: list[int], parents: list[int], probs: torch.Tensor,
                  generator: torch.Generator) -> tuple[list[int], int]:
    """(accepted node indices, root first; bonus token) of a tree (``tokens``, ``parents``: root −1) under the
    target's distributions at its nodes ``probs`` [n, V], on any device: each node's probability under its
    parent's distribution comes back in one read, the walk runs on the host, and only the bonus token is
    sampled where ``probs`` live."""
    children = child_lists(parents)
    rows = torch.tensor(parents[1:], device=probs.device)
    chance = [0.0, *probs[rows, torch.tensor(tokens[1:], device=probs.device)].tolist()]
    path, node = [0], 0
    while True:
        rejected: list[int] = []
        removed = 0.0  # mass of the rejected children: what is left of p is renormalised by 1 − removed
        accepted = None
        for child in children[node]:
            token = tokens[child]
            if token in rejected:  # a repeated sibling: its mass is already gone
                continue
            left = 1.0 - removed
            if left <= 0.0:  # cannot happen with exact arithmetic; guards rounding
                break
            if float(torch.rand((), generator=generator)) < chance[child] / left:
                accepted = child
                break
            rejected.append(token)
            removed += chance[child]
        if accepted is None:
            rest = probs[node].clone()
            rest[torch.tensor(rejected, dtype=torch.long, device=probs.device)] = 0.0
            return path, sample(rest, generator)
        node = accepted
        path.append(node)
