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

Sampled drafts (``draft_sampling="probabilistic"``): each draft is drawn from the drafter's own distribution q
(its logits under the request's temperature and top-p, as the target's), a node's children without replacement.
The rule is then the general one: accept child c with probability min(1, p(c)/q(c)); on rejection p becomes
max(0, p − q) renormalised and q loses c (renormalised), and the next child is tried; the bonus comes from what is
left of p. With a one-hot q it is the rule above. Block verification (``verification="block"``, Sun et al.,
arXiv 2403.10444, chains only) decides how many drafts to keep from the whole chain at once: with r_0 = 1 and
r_i = min(1, r_{i−1}·p_i(x_i)/q_i(x_i)), keep the first i drafts with probability h_i, the largest i whose coin
comes up wins, where h_i = m_i / (m_i + 1 − r_i) with m_i = Σ_x max(0, r_i·p_{i+1}(x) − q_{i+1}(x)), and h_k = r_k;
after τ kept drafts the next token comes from max(0, r_τ·p_{τ+1} − q_{τ+1}) (τ = k: from p_{k+1}). Its output
follows the target's distribution as well, and it keeps at least as many drafts on average as the token rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.engine.modes import DRAFT_SAMPLING, VERIFICATION
from eyas.errors import EyasError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_p filters the target's distribution as transformers does. With T > 0:
    ``draft_sampling`` (:data:`DRAFT_SAMPLING`) and ``verification`` (:data:`VERIFICATION`) choose the rule."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    draft_sampling: str = "greedy"
    verification: str = "standard"

    def __post_init__(self):
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise EyasError(f"draft sampling {self.draft_sampling!r}: one of {', '.join(DRAFT_SAMPLING)}")
        if self.verification not in VERIFICATION:
            raise EyasError(f"verification {self.verification!r}: one of {', '.join(VERIFICATION)}")

    def check_mode(self, mode: str) -> None:
        """Refuse a rule a decoding mode cannot run: drawn drafts and block verification are chain rules."""
        if self.greedy or mode != "tree":
            return
        if self.draft_sampling != "greedy":
            raise EyasError("--draft-sampling probabilistic runs with chain modes: a dynamic tree keeps its drafter's "
                            "top-k children, which were not drawn (pick chain:K, or --draft-sampling greedy)")
        if self.verification != "standard":
            raise EyasError("--verification block judges a chain's drafts together: run it with chain modes (a tree "
                            "is verified token by token)")

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


def walk_sampling(tokens: list[int], parents: list[int], probs: torch.Tensor, generator: torch.Generator,
                  draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """(accepted node indices, root first; bonus token) of a tree (``tokens``, ``parents``: root −1) under the
    target's distributions at its nodes ``probs`` [n, V], on any device. ``draft_probs`` [n, V]: the drafter's
    distribution at each node, from which its children were drawn without replacement (None: deterministic drafts,
    each a one-hot proposal). Per-node probabilities come back in few reads, the walk runs on the host, and only the
    bonus token is sampled where ``probs`` live."""
    if draft_probs is not None:
        return _walk_drawn(tokens, parents, probs, draft_probs, generator)
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


def _walk_drawn(tokens: list[int], parents: list[int], probs: torch.Tensor, draft_probs: torch.Tensor,
                generator: torch.Generator) -> tuple[list[int], int]:
    """:func:`walk_sampling` for drafts drawn from ``draft_probs``: the general rule (module docstring)."""
    children = child_lists(parents)
    path, node = [0], 0
    while True:
        p, q = probs[node].float(), draft_probs[node].float()
        accepted = None
        for child in children[node]:
            token = tokens[child]
            p_token, q_token = (float(v) for v in torch.stack([p[token], q[token]]).tolist())
            if float(torch.rand((), generator=generator)) * q_token < p_token:  # u < min(1, p/q)
                accepted = child
                break
            p = (p - q).clamp(min=0.0)
            p = p / p.sum().clamp(min=1e-30)
            q = q.clone()
            q[token] = 0.0
            q = q / q.sum().clamp(min=1e-30)
        if accepted is None:
            return path, sample(p, generator)
        node = accepted
        path.append(node)


def block_verdict(drafts: list[int], probs: torch.Tensor, draft_probs: torch.Tensor | None,
                  generator: torch.Generator) -> tuple[int, int]:
    """Block verification of a chain (module docstring): ``drafts`` [k] after the root, the target's distributions
    at the root and each draft ``probs`` [k + 1, V], the drafter's ``draft_probs`` [k, V] each draft was drawn from
    (None: deterministic drafts, one-hot) → (drafts kept, the token after them)."""
    k, device = len(drafts), probs.device
    index, chosen = torch.arange(k, device=device), torch.tensor(drafts, device=device)
    p = probs.float()
    q = (torch.zeros(k, p.shape[-1], device=device).index_put_((index, chosen), torch.tensor(1.0, device=device))
         if draft_probs is None else draft_probs.float())
    p_drafts, q_drafts = torch.stack([p[index, chosen], q[index, chosen]]).tolist()
    ratio = [1.0]  # r_0 … r_k
    for p_i, q_i in zip(p_drafts, q_drafts, strict=True):
        ratio.append(min(1.0, ratio[-1] * p_i / q_i) if q_i > 0 else 0.0)
    # residual masses m_1 … m_{k−1}: what is left of r_i·p_{i+1} above q_{i+1}, one read for all of them
    masses = (torch.tensor(ratio[1:k], device=device)[:, None] * p[1:k] - q[1:k]).clamp(min=0.0).sum(-1).tolist()
    keep_chance = [m / (m + 1.0 - r) if m + 1.0 - r > 0 else 1.0 for m, r in zip(masses, ratio[1:k], strict=True)]
    keep_chance.append(ratio[k])
    kept = 0
    for i, chance in enumerate(keep_chance, start=1):
        if float(torch.rand((), generator=generator)) < chance:
            kept = i
    if kept == k:
        return kept, sample(p[k], generator)
    rest = (ratio[kept] * p[kept] - q[kept]).clamp(min=0.0)
    return kept, sample(rest if float(rest.sum()) > 0 else p[kept], generator)
