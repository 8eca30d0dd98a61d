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

from dataclasses import dataclass

import torch

from eyas.engine.draft_runner import DraftRunner


@dataclass
class DraftTree:
    """``tokens`` [n] target ids (root first), ``parents`` [n] (root: -1), ``depths`` [n]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Child node indices in tree order (best-scored first: nodes are stored by score)."""
        return (self.parents == node).nonzero().flatten().tolist()


def chain_tree(root: int, drafts: torch.Tensor) -> DraftTree:
    """A chain: root, then each draft the child of the one before."""
    n = len(drafts) + 1
    return DraftTree(tokens=torch.cat([torch.tensor([root]), drafts.cpu()]), parents=torch.arange(-1, n - 1),
                     depths=torch.arange(n))


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: node i may see node j when j is i or an ancestor of i (parents precede children)."""
    n = len(parents)
    rows = torch.arange(n)
    mask = torch.eye(n, dtype=torch.bool)
    ancestor = parents.clone()
    while bool((ancestor >= 0).any()):  # one step up per pass: as many passes as the tree is deep
        climbing = ancestor >= 0
        mask[rows[climbing], ancestor[climbing]] = True
        ancestor[climbing] = parents[ancestor[climbing]]
    return mask


@torch.no_grad()
def draft_tree(drafter: DraftRunner, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
               root: int, top_k: int, depth: int, total: int) -> DraftTree:
    """Commit the target states ``aux`` (as :meth:`DraftRunner.draft_chain`) and grow a dynamic tree of
    ``total`` draft tokens after ``root`` (the token following the last of them).

    The growth stays on the drafter's device (each level's inputs come from the previous level's
    outputs); the proposals cross to the host once, at the end, to be selected."""
    drafter.rollback()
    n = next_tokens.shape[1]
    prenorm, scores, ids = drafter.step(aux, next_tokens, positions, torch.ones(n, n, dtype=torch.bool).tril(),
                                        commit=True, top_k=top_k, from_target=True)
    base = int(positions[0, -1])  # the drafter runs a depth-d node at base + d (its row holds the next token)
    d2t, device = drafter.drafter.d2t, drafter.device
    scores, ids = scores[-1], ids[-1]
    # every proposal, level by level: draft id, parent (index into all proposals, -1 = root), score
    proposed_ids, proposed_scores = [ids], [scores]
    proposed_parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device)  # the nodes expanded next, as indices into all proposals
    frontier_scores, frontier_tokens = scores, ids + d2t[ids]
    frontier_hidden = prenorm[:, -1:].expand(1, top_k, -1)
    # the speculative drafter entries, top_k per level in the order written; row r of a level holds
    # frontier node r. ancestors[r]: which written entries frontier node r descends from.
    ancestors = torch.zeros(top_k, 0, dtype=torch.bool, device=device)
    itself = torch.eye(top_k, dtype=torch.bool, device=device)
    offset = top_k
    for level in range(2, depth + 1):
        window = torch.cat([ancestors, itself], dim=1)
        hidden, child_scores, child_ids = drafter.step(
            frontier_hidden, frontier_tokens.view(1, -1), torch.full((1, top_k), base + level - 1, dtype=torch.long),
            window, commit=False, top_k=top_k)
        child_scores = (child_scores + frontier_scores[:, None]).flatten()
        child_ids = child_ids.flatten()
        proposed_ids.append(child_ids)
        proposed_scores.append(child_scores)
        proposed_parents.append(frontier.repeat_interleave(top_k))
        frontier_scores, best = child_scores.topk(top_k)
        parent_rows = best // top_k  # which frontier node (= which just-written entry) each new node extends
        ancestors = window[parent_rows]  # a child sees what its parent saw, and its parent
        frontier = offset + best
        offset += len(child_ids)
        frontier_tokens = child_ids[best] + d2t[child_ids[best]]
        frontier_hidden = hidden[:, parent_rows]
    drafter.rollback()
    flat_ids, flat_parents, flat_scores = (torch.cat(parts).cpu() for parts in (proposed_ids, proposed_parents, proposed_scores))
    flat_depths = torch.repeat_interleave(torch.arange(1, depth + 1), torch.tensor([len(p) for p in proposed_ids]))
    return _select(flat_ids, flat_parents, flat_scores, flat_depths, drafter.d2t_host, root, total)


def _select(flat_ids: torch.Tensor, flat_parents: torch.Tensor, flat_scores: torch.Tensor, flat_depths: torch.Tensor,
            d2t: torch.Tensor, root: int, total: int) -> DraftTree:
    """The ``total`` best proposals by score (ties: shallower, then earlier), ordered by depth then score."""
    # proposals are stored by depth, then index: a stable sort by score alone breaks ties the right way
    by_score = torch.sort(-flat_scores, stable=True).indices[: min(total, len(flat_ids))]
    chosen = by_score[torch.sort(flat_depths[by_score], stable=True).indices]  # by depth; within one, by score
    node_of = torch.full((len(flat_ids),), -1, dtype=torch.long)
    node_of[chosen] = torch.arange(1, len(chosen) + 1)  # tree node 0 is the root
    chosen_parents = flat_parents[chosen]
    tree_parents = torch.where(chosen_parents < 0, 0, node_of[chosen_parents.clamp(min=0)])
    if bool((tree_parents < 0).any()):
        raise AssertionError("a selected draft node lacks its parent; scores must not increase along a path")
    tokens = flat_ids[chosen] + d2t[flat_ids[chosen]]
    return DraftTree(tokens=torch.cat([torch.tensor([root]), tokens]), parents=torch.cat([torch.tensor([-1]), tree_parents]),
                     depths=torch.cat([torch.tensor([0]), flat_depths[chosen]]))
