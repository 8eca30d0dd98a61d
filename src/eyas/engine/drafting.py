"""Drafting a round's candidates on the device: a greedy chain, or EAGLE-2's dynamic tree.

Both start the same way: the drafter commits the states the target accepted last round (each with the
token after it) and proposes from the last of them. A chain then feeds each greedy draft back, one
drafter pass a token. A dynamic tree (EAGLE-2, arXiv 2406.16858; the EAGLE reference's defaults top-k
10, depth 7, 60 draft tokens) scores a node by the sum of the drafter's log-probabilities along its
path: each depth, the ``top_k`` best nodes of the previous depth (the frontier) are run through the
drafter, each proposes its ``top_k`` best children, and the ``top_k`` best of those become the next
frontier; after ``depth`` levels the ``total`` best nodes of everything proposed form the tree. A child
never scores above its parent, so the best nodes always include their ancestors (ties broken towards
shallower, earlier nodes to keep that true). Every shape is fixed and every number stays on the
device: no host synchronisation anywhere, so a round can be recorded as one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from eyas.engine.modes import tree_size
from eyas.engine.topk import largest

if TYPE_CHECKING:  # the runner of drafters that draft one token a pass (EAGLE-3's)
    from eyas.families.eagle3.runner import DraftRunner


def draft_chain(drafter: DraftRunner, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                length: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
    """Commit the first ``valid`` [1] of the target states ``aux`` [1, n, k·Ht] (each with the token after it, at
    ``positions`` [1, n]) after ``length`` [1] committed ones, then draft ``steps`` tokens greedily from the last
    valid one → target ids [steps]."""
    return _chain(drafter, aux, next_tokens, positions, length, valid, steps, 1,
                  lambda hidden, ids: drafter.drafter.to_target_ids(ids).view(1, 1))


# A drawn chain's step: the drafter's logits over its vocabulary [Vd] → (the target id drawn [1, 1], the distribution
# it was drawn from over the drafter's vocabulary [Vd]).
Draw = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draw_chain(drafter: DraftRunner, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
               length: torch.Tensor, valid: torch.Tensor, steps: int, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_chain` with each draft drawn from the drafter's distribution by ``draw`` (sampled rounds)
    → (target ids [steps], the distribution each was drawn from [steps, Vd])."""
    rows = []

    def pick(hidden, ids):
        token, row = draw(drafter.logits(hidden)[-1])
        rows.append(row)
        return token.view(1, 1)

    return _chain(drafter, aux, next_tokens, positions, length, valid, steps, 0, pick), torch.stack(rows)


def _chain(drafter: DraftRunner, aux, next_tokens, positions, length, valid, steps: int, top_k: int,
           pick: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """A chain's passes: commit, then one speculative pass per further draft; ``pick`` (pre-norm [1, 1, H], top-k ids
    or None) → the step's target id [1, 1]."""
    hidden, _, ids, position, committed = drafter.commit(aux, next_tokens, positions, length, valid, top_k)
    token = pick(hidden, ids)
    drafted = [token]
    for step in range(1, steps):  # step i sees the committed positions and the i − 1 drafts before it
        position = position + 1
        window = torch.ones(1, step, dtype=torch.bool, device=drafter.device)
        hidden, _, ids = drafter.speculate(hidden, token, position, committed, step - 1, window, top_k)
        token = pick(hidden, ids)
        drafted.append(token)
    return torch.cat(drafted, dim=1)[0]


def draft_tree(drafter: DraftRunner, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
               length: torch.Tensor, valid: torch.Tensor, top_k: int, depth: int, total: int,
               proposal_depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Commit the target states as :func:`draft_chain` does, then grow a dynamic tree from the last valid one
    → the :func:`tree_size` best nodes (target ids, parents as node indices — 0 is the root, the token after
    the last state —, depths). ``proposal_depth``: :func:`proposal_depths`, made once."""
    hidden, scores, ids, base, committed = drafter.commit(aux, next_tokens, positions, length, valid, top_k)

    def run_level(frontier_hidden, tokens, level, window):  # depth level − 1 nodes run at base + level − 1
        return drafter.speculate(frontier_hidden, tokens, (base + level - 1).expand(1, top_k), committed,
                                 (level - 2) * top_k, window, top_k)

    d2t = drafter.drafter.d2t
    flat = grow(hidden, scores[0], ids[0], d2t, top_k, depth, run_level)
    return select(*flat, proposal_depth, d2t, tree_size(top_k, depth, total))


def ancestor_mask(parents: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """[n, n] bool: node i may see node j when j is i or an ancestor of i (parents precede children).

    Each pass gives every node its parent's row plus itself, so after ``levels`` passes (the tree's
    depth; by default the most any n-node tree can have) every row is complete. A fixed number of
    passes and no data-dependent control flow."""
    n = len(parents)
    itself = torch.eye(n, dtype=torch.bool, device=parents.device)
    has_parent = (parents >= 0).unsqueeze(1)
    parent_rows = parents.clamp(min=0)
    mask = itself
    for _ in range(n - 1 if levels is None else levels):
        mask = itself | (mask.index_select(0, parent_rows) & has_parent)
    return mask


# A tree level's drafter pass: (frontier hidden [1, top_k, H], frontier target ids [1, top_k], level, window
# [top_k, entries so far + top_k]) → (pre-norm [1, top_k, H], child log-probs [top_k, top_k], draft ids [top_k, top_k]).
RunLevel = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def grow(hidden: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, d2t: torch.Tensor, top_k: int, depth: int,
         run_level: RunLevel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every proposal of a dynamic tree, level by level: (draft ids, parents — indices into the proposals, −1 =
    the root —, scores), each [top_k + (depth − 1)·top_k²]. The first level is the root's ``top_k`` children
    (``scores``, ``ids`` [top_k], proposed from ``hidden`` [1, 1, H]); ``run_level`` runs the drafter on each
    later frontier."""
    device = ids.device
    proposed_ids, proposed_scores = [ids], [scores]
    proposed_parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device)  # the nodes expanded next, as indices into all proposals
    frontier_scores, frontier_tokens = scores, ids + d2t[ids]
    frontier_hidden = hidden.expand(1, top_k, -1)
    # the speculative drafter entries, top_k per level in the order written; row r of a level holds
    # frontier node r. ancestors[r]: which written entries frontier node r descends from.
    ancestors = torch.zeros(top_k, 0, dtype=torch.bool, device=device)
    itself = torch.eye(top_k, dtype=torch.bool, device=device)
    offset = top_k
    for level in range(2, depth + 1):
        window = torch.cat([ancestors, itself], dim=1)
        hidden, child_scores, child_ids = run_level(frontier_hidden, frontier_tokens.view(1, -1), level, window)
        child_scores = (child_scores + frontier_scores[:, None]).flatten()
        child_ids = child_ids.flatten()
        proposed_ids.append(child_ids)
        proposed_scores.append(child_scores)
        proposed_parents.append(frontier.repeat_interleave(top_k))
        frontier_scores, best = (part[0] for part in largest(child_scores.view(1, -1), top_k))
        parent_rows = best // top_k  # which frontier node (= which just-written entry) each new node extends
        ancestors = window.index_select(0, parent_rows)  # a child sees what its parent saw, and its parent
        frontier = offset + best
        offset += len(child_ids)
        frontier_tokens = child_ids[best] + d2t[child_ids[best]]
        frontier_hidden = hidden.index_select(1, parent_rows)
    return torch.cat(proposed_ids), torch.cat(proposed_parents), torch.cat(proposed_scores)


def proposal_depths(top_k: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """The depth of each proposal :func:`grow` returns: top_k at depth 1, top_k² at each later one."""
    counts = torch.tensor([top_k] + [top_k * top_k] * (depth - 1))
    return torch.repeat_interleave(torch.arange(1, depth + 1), counts).to(device)


# Up to this many proposals, :func:`select` ranks them by comparing every pair (one fused kernel on a GPU); more are
# sorted. A tree:60,7,10 round proposes 610: on an H100 its radix sort took 25.7 µs of a 2.2 ms round, the longest
# kernel of the drafter's part (benchmarks/results/2026-12-06_h100_engine-defaults-2, round_tree_w8_60.txt).
PAIRWISE_MOST = 2048


def select(flat_ids: torch.Tensor, flat_parents: torch.Tensor, flat_scores: torch.Tensor, flat_depths: torch.Tensor,
           d2t: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``total`` best proposals by score (ties: shallower, then earlier), ordered by depth then score
    → (target ids, parents as tree node indices (0 = the root), depths), each [min(total, proposals)]."""
    count = min(total, len(flat_ids))
    order = _best_by_pairs if len(flat_ids) <= PAIRWISE_MOST else _best_by_sort
    chosen = order(flat_scores, flat_depths, count)
    node_of = torch.full((len(flat_ids),), -1, dtype=torch.long, device=flat_ids.device)
    node_of.index_copy_(0, chosen, torch.arange(1, count + 1, device=flat_ids.device))  # tree node 0 is the root
    chosen_parents = flat_parents.index_select(0, chosen)
    parents = torch.where(chosen_parents < 0, 0, node_of.index_select(0, chosen_parents.clamp(min=0)))
    ids = flat_ids.index_select(0, chosen)
    return ids + d2t.index_select(0, ids), parents, flat_depths.index_select(0, chosen)


def _best_by_sort(scores: torch.Tensor, depths: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the ``count`` best proposals (by score, ties to the earlier), ordered by depth then score. The
    proposals are stored by depth, then index: a stable sort by score alone breaks ties the right way."""
    by_score = torch.sort(-scores, stable=True).indices[:count]
    return by_score.index_select(0, torch.sort(depths.index_select(0, by_score), stable=True).indices)


def _best_by_pairs(scores: torch.Tensor, depths: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`_best_by_sort`'s answer from pairwise comparisons, without a sort: a proposal's rank is how many score
    above it (or equal and come earlier); the chosen ones (rank < count) are placed by (depth, rank)."""
    n = len(scores)
    index = torch.arange(n, device=scores.device)
    ahead = (scores[None, :] > scores[:, None]) | ((scores[None, :] == scores[:, None]) & (index[None, :] < index[:, None]))
    rank = ahead.sum(1)
    chosen = rank < count
    key = depths * n + rank  # distinct: ranks are
    place = ((key[None, :] < key[:, None]) & chosen[None, :]).sum(1)
    at = (place[None, :] == torch.arange(count, device=scores.device)[:, None]) & chosen[None, :]  # [count, n], one-hot rows
    return (at.long() * index).sum(1)
