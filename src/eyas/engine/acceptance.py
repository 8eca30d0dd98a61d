"""Which drafted nodes the target accepts, and the token it emits after them (the bonus).

Greedy, the rule: a node is accepted when its parent is and its token is the target's argmax at its
parent; the argmax at the deepest accepted node is the bonus. The output is then the target's own greedy
output, token for token. It runs on the device with no host synchronisation (:func:`tree_verdict`;
:func:`chain_verdict` is the same rule for a chain, in four kernels).

Sampled, the rules run on the device too, with no host synchronisation: every random choice reads a uniform the
caller drew beforehand (a round's row of uniforms, :func:`draw` inverting a cumulative sum at one), so a sampled
round is recorded and replayed in bursts as a greedy one is. Each rule's output follows the target's distribution
(tests count it, and count a deliberately wrong rule failing):

- deterministic drafts (``draft_sampling="greedy"``: argmax chains, top-k trees) are proposals of probability one.
  At a node with target distribution p, its children are tried in order: child c is accepted with probability
  p(c); on rejection p(c) becomes 0 and p is renormalised for the next child; if every child is rejected the bonus
  comes from what is left of p. Child c given its earlier siblings' rejection is thus accepted with probability
  p(c) / (1 − Σ earlier siblings' p), which :func:`tree_sampled` evaluates for every node at once;
- drafts drawn from the drafter's own distribution q (``draft_sampling="probabilistic"``, or "auto" in chains, and in
  trees from :data:`DRAWN_TREES_FROM`: its logits under the request's temperature and top-p, as the target's): draft x
  is accepted with probability min(1, p(x)/q(x)), and after a rejection the bonus comes from max(0, p − q)
  renormalised (:func:`chain_sampled`; a one-hot q is the rule above); a tree's children are drawn without
  replacement into a static shape, the r-th judged against q without its earlier siblings (:func:`tree_drawn`);
- block verification (``verification="block"``, Sun et al., arXiv 2403.10444, chains) decides how many drafts to
  keep from the whole chain at once: with r_0 = 1 and r_i = min(1, r_{i−1}·p_i(x_i)/q_i(x_i)), keep the first i
  drafts with probability h_i, the largest i whose coin comes up wins, where h_i = m_i / (m_i + 1 − r_i) with
  m_i = Σ_x max(0, r_i·p_{i+1}(x) − q_{i+1}(x)), and h_k = r_k; after τ kept drafts the next token comes from
  max(0, r_τ·p_{τ+1} − q_{τ+1}) (τ = k: from p_{k+1}). It keeps at least as many drafts on average as the token
  rule (:func:`block_sampled`).
"""

from __future__ import annotations

import torch

from eyas.sampling import draw, sampling_probs
from eyas.speculation import Sampling  # the request's rule (re-exported here: the engine's importers)


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the target samples from under ``sampling`` (:func:`eyas.sampling.sampling_probs`)."""
    return sampling_probs(logits, sampling.temperature, sampling.top_p)


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
    agrees = (parents < 0) | (tokens == choice.index_select(0, parents.clamp(min=0)))
    deepest, accepted, path = _accepted_path(agrees, parents, depths, levels)
    return accepted, choice.index_select(0, deepest), path


def _accepted_path(agrees: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                   levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nodes the target ``agrees`` with [n] (the root always; at most one child of a node) → (the deepest node whose
    every ancestor it agrees with [1], its depth = drafts accepted [1], the path to it as :func:`tree_verdict`'s)."""
    parent_rows = parents.clamp(min=0)
    accepted_nodes = agrees
    for _ in range(levels):  # one more level settled per pass
        accepted_nodes = agrees & accepted_nodes.index_select(0, parent_rows)
    deepest = torch.where(accepted_nodes, depths, -1).argmax().view(1)
    accepted = depths.index_select(0, deepest)
    # climb from the deepest accepted node: up[i] is its i-th ancestor (the root, once past it)
    up = [deepest]
    for _ in range(levels):
        up.append(parent_rows.index_select(0, up[-1]))
    steps_up = (accepted - torch.arange(levels + 1, device=agrees.device)).clamp(min=0)
    return deepest, accepted, torch.cat(up).index_select(0, steps_up)


def _earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: node s is a sibling of node c tried before it (same parent, earlier in node order), at [c, s]."""
    order = torch.arange(len(parents), device=parents.device)
    return (parents.view(1, -1) == parents.view(-1, 1)) & (order.view(1, -1) < order.view(-1, 1))


def _tried_path(coin_up: torch.Tensor, earlier: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path (:func:`_accepted_path`'s outputs) from each child's coin [n]: a child is accepted when its coin
    came up and it was tried, i.e. every earlier sibling's coin (``earlier``: :func:`_earlier_siblings`) did not."""
    first_up = coin_up & ~(earlier & coin_up.view(1, -1)).any(-1)
    return _accepted_path((parents < 0) | first_up, parents, depths, levels)


def _bonus(residuals: torch.Tensor, fallback: torch.Tensor, row: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The bonus token [1] drawn at ``uniform`` [1] from ``residuals``' row ``row`` [1] — or, where rounding left that
    row no mass, from the same row of ``fallback``."""
    chosen, plain = residuals.index_select(0, row), fallback.index_select(0, row)
    empty = chosen.sum(-1, keepdim=True) <= 0
    return draw(torch.where(empty, plain, chosen), uniform)


def _draft_chances(drafts: torch.Tensor, probs: torch.Tensor,
                   draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both chain rules read: the drafter's distribution behind each draft q [k, V] (deterministic drafts, None:
    each its own token with probability one), and each draft's probability under the target p and under q [k]."""
    k = len(drafts)
    column = drafts.view(-1, 1)
    if draft_probs is None:
        q = torch.zeros(k, probs.shape[-1], dtype=probs.dtype, device=drafts.device).scatter_(1, column, 1.0)
    else:
        q = draft_probs.to(probs.dtype)
    return q, probs[:k].gather(1, column)[:, 0], q.gather(1, column)[:, 0]


def chain_sampled(drafts: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor | None,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rule for a chain (module docstring): ``drafts`` [k] after the root, the target's distributions at
    the root and each draft ``probs`` [k + 1, V], the drafter's ``draft_probs`` [k, V] each draft was drawn from
    (None: deterministic drafts), ``uniforms`` [k + 1] (a coin per draft, then the bonus's) → (drafts accepted [1],
    bonus [1])."""
    k = len(drafts)
    q, p_drafts, q_drafts = _draft_chances(drafts, probs, draft_probs)
    accepted = (uniforms[:k] * q_drafts < p_drafts).long().cumprod(0).sum().view(1)  # u < min(1, p/q)
    residuals = torch.cat([(probs[:k] - q).clamp(min=0.0), probs[k:]])
    return accepted, _bonus(residuals, probs, accepted, uniforms[k:])


def block_sampled(drafts: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor | None,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification of a chain (module docstring), with :func:`chain_sampled`'s arguments → (drafts kept [1],
    bonus [1])."""
    k = len(drafts)
    q, p_drafts, q_drafts = _draft_chances(drafts, probs, draft_probs)
    steps = torch.where(q_drafts > 0, p_drafts / q_drafts.clamp(min=1e-30), 0.0)
    ratio = [torch.ones_like(steps[:1])]  # r_0 … r_k, each [1]
    for i in range(k):
        ratio.append(torch.clamp(ratio[-1] * steps[i : i + 1], max=1.0))
    ratio = torch.cat(ratio)
    # residual rows: max(0, r_i·p_i − q_i) for i < k, and p_k past the last draft
    residuals = torch.cat([(ratio[:k, None] * probs[:k] - q).clamp(min=0.0), probs[k:]])
    masses, inner = residuals[1:k].sum(-1), ratio[1:k]
    room = masses + 1.0 - inner
    chances = torch.cat([torch.where(room > 0, masses / room.clamp(min=1e-30), 1.0), ratio[k:]])
    places = torch.arange(1, k + 1, device=drafts.device)
    kept = (places * (uniforms[:k] < chances)).max().view(1)  # the largest i whose coin came up; none: 0
    return kept, _bonus(residuals, probs, kept, uniforms[k:])


def tree_sampled(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, probs: torch.Tensor,
                 uniforms: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token rule for a tree of deterministic drafts (module docstring): ``tokens``, ``parents`` (root −1),
    ``depths`` [n] as :func:`tree_verdict`'s, the target's distributions at every node ``probs`` [n, V],
    ``uniforms`` [n] (node c's coin at c, the bonus's at 0) → (drafts accepted [1], bonus [1], path). Siblings are
    tried in node order (best-scored first)."""
    parent_rows = parents.clamp(min=0)
    chance = probs.index_select(0, parent_rows).gather(1, tokens.view(-1, 1))[:, 0]  # p(c) under its parent's p
    earlier = _earlier_siblings(parents)
    rejected_mass = (earlier.to(chance.dtype) * chance.view(1, -1)).sum(-1)
    coin_up = uniforms * (1.0 - rejected_mass).clamp(min=0.0) < chance  # u < p(c) / (1 − Σ earlier siblings' p)
    deepest, accepted, path = _tried_path(coin_up, earlier, parents, depths, levels)
    # the bonus: the deepest accepted node's p without its children's tokens (each of them was tried and rejected)
    row = probs.index_select(0, deepest)
    tried = torch.zeros(probs.shape[-1], dtype=probs.dtype, device=probs.device)
    tried.index_add_(0, tokens, (parents == deepest).to(probs.dtype))
    residual = row.masked_fill(tried.view(1, -1) > 0, 0.0)
    return accepted, _bonus(residual, row, torch.zeros_like(deepest), uniforms[:1]), path


def tree_drawn(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, probs: torch.Tensor,
               hosts: torch.Tensor, draft_probs: torch.Tensor, uniforms: torch.Tensor, levels: int,
               siblings: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule for a tree whose children were drawn without replacement from the drafter (module docstring;
    :mod:`eyas.engine.drawn_tree`): ``tokens``, ``parents``, ``depths`` [n] as :func:`tree_verdict`'s, siblings in
    the order drawn; the target's distributions at every node ``probs`` [n, V]; the nodes with children ``hosts`` [h]
    and the drafter's distribution at each ``draft_probs`` [h, V]; ``uniforms`` [n] as :func:`tree_sampled`'s;
    ``siblings``: the most children a node has → (drafts accepted [1], bonus [1], path).

    At a node, the r-th child drawn follows q_r, q without the earlier children's tokens, renormalised; it is accepted
    with probability min(1, p_r(x)/q_r(x)), and after its rejection p_{r+1} = max(0, p_r − q_r) renormalised (p_0 =
    p). A child is what q_r draws whatever happened before, so each step is the chain's rule, and the node emits p.
    A child whose token q_r gives no mass (q had fewer tokens than the node has children) is never accepted and
    leaves p_r as it is. Every host's children are judged at once, rank by rank."""
    n, h = len(tokens), len(hosts)
    device = tokens.device
    order = torch.arange(n, device=device)
    earlier = _earlier_siblings(parents)
    host_row = torch.full((n,), h, dtype=torch.long, device=device).index_copy_(0, hosts, torch.arange(h, device=device))
    # child_of[host row, rank] → the child (−1: none); the root and children of no host write to a spare entry
    slot = torch.where(parents >= 0, host_row.index_select(0, parents.clamp(min=0)) * siblings + earlier.sum(-1),
                       h * siblings)
    child_of = torch.full((h * siblings + 1,), -1, dtype=torch.long, device=device).index_copy_(0, slot, order)
    child_of = child_of[:-1].view(h, siblings)
    residual = probs.index_select(0, hosts)  # p_r at every host
    remaining = draft_probs.to(probs.dtype)  # q without the children judged so far (unnormalised)
    coin_up = torch.zeros(n + 1, dtype=torch.bool, device=device)  # per child; the last entry takes nobody's
    for rank in range(siblings):
        child = child_of[:, rank]
        exists = child >= 0
        token = tokens.index_select(0, child.clamp(min=0)).view(-1, 1)
        mass = remaining.sum(-1, keepdim=True)
        q_r = torch.where(mass > 0, remaining / mass.clamp(min=1e-30), 0.0)
        p_x, q_x = residual.gather(1, token)[:, 0], q_r.gather(1, token)[:, 0]
        coin = uniforms.index_select(0, child.clamp(min=0))
        up = exists & (q_x > 0) & (coin * q_x < p_x)  # u < min(1, p_r(x) / q_r(x))
        coin_up.index_copy_(0, torch.where(exists, child, n), up)
        left = (residual - q_r).clamp(min=0.0)
        left_mass = left.sum(-1, keepdim=True)
        judged = (exists & (q_x > 0)).view(-1, 1) & (left_mass > 0)
        residual = torch.where(judged, left / left_mass.clamp(min=1e-30), residual)
        remaining = remaining.scatter(1, token, torch.where(exists.view(-1, 1), 0.0, remaining.gather(1, token)))
    deepest, accepted, path = _tried_path(coin_up[:n], earlier, parents, depths, levels)
    # the bonus: from what is left of the deepest accepted node's p after its children (a leaf: p itself)
    row = host_row.index_select(0, deepest)
    left = torch.cat([residual, probs.index_select(0, deepest)]).index_select(0, row)
    return accepted, _bonus(left, probs.index_select(0, deepest), torch.zeros_like(deepest), uniforms[:1]), path
