"""Draft trees: a chain is a tree with one child per node; EAGLE-2's dynamic tree grows by score.

Node 0 is the root: the last token the target emitted, not yet run by it. Every other node is a
drafted target id with a parent (an earlier node) and a depth (root 0). The target verifies all
nodes in one forward, each at position start + depth, each attending to the committed context, its
ancestors and itself (:func:`ancestor_mask`).

Dynamic tree (EAGLE-2, arXiv 2406.16858; the EAGLE reference's defaults top-k 10, depth 7, 60 draft
tokens): a node's score is the sum of the drafter's log-probabilities along its path. Each depth,
the ``top_k`` best nodes of the previous depth are run through the drafter (the frontier), each
proposes its ``top_k`` best children, and the ``top_k`` best of those become the next frontier.
After ``depth`` levels the ``total`` best nodes of everything proposed form the tree: a child never
scores above its parent, so the best nodes always include their ancestors (ties broken towards
shallower, earlier nodes to keep that true).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eyas.engine.draft_runner import DraftRunner
from eyas.engine.topk import largest


@dataclass
class DraftTree:
    """``tokens`` [n] target ids (root first), ``parents`` [n] (root: -1), ``depths`` [n]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def child_lists(self) -> list[list[int]]:
        """Every node's child node indices in tree order (best-scored first: nodes are stored by score),
        from one read of the parents (for walks on the host)."""
        lists: list[list[int]] = [[] for _ in range(len(self.parents))]
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                lists[parent].append(node)
        return lists


def chain_tree(root: int, drafts: torch.Tensor) -> DraftTree:
    """A chain: root, then each draft the child of the one before."""
    n = len(drafts) + 1
    return DraftTree(tokens=torch.cat([torch.tensor([root]), drafts.cpu()]), parents=torch.arange(-1, n - 1),
                     depths=torch.arange(n))


def ancestor_mask(parents: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """[n, n] bool: node i may see node j when j is i or an ancestor of i (parents precede children).

    Each pass gives every node its parent's row plus itself, so after ``levels`` passes (the tree's
    depth; by default the most any n-node tree can have) every row is complete. A fixed number of
    passes and no data-dependent control flow: the same code runs on the host and in a recorded round."""
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
    """Every proposal of a dynamic tree, level by level, on the drafter's device with no host
    synchronisation: (draft ids, parents — indices into the proposals, −1 = the root —, scores), each
    [top_k + (depth − 1)·top_k²]. The first level is the root's ``top_k`` children (``scores``, ``ids``
    [top_k], proposed from ``hidden`` [1, 1, H]); ``run_level`` runs the drafter on each later frontier."""
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


def select(flat_ids: torch.Tensor, flat_parents: torch.Tensor, flat_scores: torch.Tensor, flat_depths: torch.Tensor,
           d2t: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``total`` best proposals by score (ties: shallower, then earlier), ordered by depth then score
    → (target ids, parents as tree node indices (0 = the root), depths), each [min(total, proposals)];
    where the proposals are, with no host synchronisation."""
    count = min(total, len(flat_ids))
    # proposals are stored by depth, then index: a stable sort by score alone breaks ties the right way
    by_score = torch.sort(-flat_scores, stable=True).indices[:count]
    chosen = by_score.index_select(0, torch.sort(flat_depths.index_select(0, by_score), stable=True).indices)
    node_of = torch.full((len(flat_ids),), -1, dtype=torch.long, device=flat_ids.device)
    node_of.index_copy_(0, chosen, torch.arange(1, count + 1, device=flat_ids.device))  # tree node 0 is the root
    chosen_parents = flat_parents.index_select(0, chosen)
    parents = torch.where(chosen_parents < 0, 0, node_of.index_select(0, chosen_parents.clamp(min=0)))
    ids = flat_ids.index_select(0, chosen)
    return ids + d2t.index_select(0, ids), parents, flat_depths.index_select(0, chosen)


@torch.no_grad()
def draft_tree(drafter: DraftRunner, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
               root: int, top_k: int, depth: int, total: int) -> DraftTree:
    """Commit the target states ``aux`` (as :meth:`DraftRunner.draft_chain`) and grow a dynamic tree of
    ``total`` draft tokens after ``root`` (the token following the last of them).

    Growth and selection stay on the drafter's device (each level's inputs come from the previous
    level's outputs); the chosen nodes cross to the host once."""
    prenorm, scores, ids = drafter.commit(aux, next_tokens, positions, top_k)
    base = int(positions[0, -1])  # the drafter runs a depth-d node at base + d (its row holds the next token)

    def run_level(hidden, tokens, level, window):
        return drafter.step(hidden, tokens, torch.full((1, top_k), base + level - 1, dtype=torch.long), window,
                            commit=False, top_k=top_k)

    d2t = drafter.drafter.d2t
    flat = grow(prenorm[:, -1:], scores[-1], ids[-1], d2t, top_k, depth, run_level)
    drafter.rollback()
    tokens, parents, depths = (part.cpu() for part in select(*flat, proposal_depths(top_k, depth, d2t.device), d2t, total))
    if bool(((parents < 0) | (parents >= torch.arange(1, len(parents) + 1))).any()):
        raise AssertionError("a selected draft node lacks its parent; scores must not increase along a path")
    return DraftTree(tokens=torch.cat([torch.tensor([root]), tokens]), parents=torch.cat([torch.tensor([-1]), parents]),
                     depths=torch.cat([torch.tensor([0]), depths]))
