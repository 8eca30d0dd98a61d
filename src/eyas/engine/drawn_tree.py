"""A tree whose children are drawn from the drafter: a static shape, children drawn without replacement.

A dynamic tree (:mod:`eyas.engine.drafting`) keeps the children its drafter scores best, and which ones it keeps depends
on their values: that is fine for deterministic drafts, but drawn children selected by their scores no longer follow
the drafter's distribution, and the lossless rule for drawn drafts (:func:`eyas.engine.acceptance.tree_drawn`) needs
them to. So a drawn tree has a shape fixed in advance, which says only how many children each node draws: node
(parent, rank r) is the r-th token drawn without replacement from the drafter's distribution at its parent. The
tokens vary; the shape, every drafter pass and every mask are constants, so a round is still one CUDA graph.

The shape is the best ``total`` nodes of a tree ``depth`` deep, at most ``top_k`` children a node and ``top_k`` nodes
expanded a level (the bounds of ``tree:TOTAL,DEPTH,TOPK``, so a drawn tree fits the caches its dynamic twin sizes),
scored by a prior in place of the drafter's log-probabilities: the chance that a node lies on the accepted path, if
the r-th child drawn at a node is the accepted one with chance α(1 − α)^r (:data:`FIRST_DRAW_ACCEPTED` = α): a node's
score is the product along its path. Every deeper node or later sibling halves a node's chance at α = 1/2, so the
best 60 nodes of tree:60,7,10 are the paths whose depth plus ranks is at most 6 (and some at 7).

Draws without replacement are Gumbel draws (Kool et al., arXiv 1903.06059): the k largest of log q + Gumbel noise,
in descending order, are k tokens drawn one after another without replacement from q — one top-k of a row of
uniforms the caller drew beforehand, no sequential loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import torch

from eyas.engine.drafting import ancestor_mask
from eyas.engine.modes import tree_size
from eyas.engine.topk import largest

if TYPE_CHECKING:  # the runner of drafters that draft one token a pass (EAGLE-3's)
    from eyas.families.eagle3.runner import DraftRunner


FIRST_DRAW_ACCEPTED = 0.5  # the shape's prior α: the chance the first child drawn at a node is accepted


@dataclass(frozen=True)
class DrawnTreeShape:
    """The static shape of a drawn tree: node 0 is the root; nodes are ordered by depth, then parent, then rank, so
    parents precede children and siblings follow their draw order. ``parents`` (root −1), ``depths`` and ``ranks``
    (place among siblings) each hold one entry a node."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def best(cls, top_k: int, depth: int, total: int, alpha: float = FIRST_DRAW_ACCEPTED) -> DrawnTreeShape:
        """The ``tree_size(top_k, depth, total)`` best nodes under the prior (module docstring), grown as a dynamic
        tree grows: each level expands the ``top_k`` best nodes of the last, each with ``top_k`` children; ties go to
        shallower, then earlier nodes, as :func:`eyas.engine.drafting.select` breaks them."""
        rank_score = [math.log(alpha) + r * math.log(1.0 - alpha) for r in range(top_k)]
        proposals = []  # (score, depth, parent proposal or −1, rank), in the order grown
        frontier = [-1]
        for level in range(1, depth + 1):
            first = len(proposals)
            for parent in frontier:
                base = 0.0 if parent < 0 else proposals[parent][0]
                proposals += [(base + rank_score[r], level, parent, r) for r in range(top_k)]
            level_nodes = range(first, len(proposals))
            frontier = sorted(level_nodes, key=lambda i: (-proposals[i][0], i))[:top_k]
        count = tree_size(top_k, depth, total)
        chosen = sorted(range(len(proposals)), key=lambda i: (-proposals[i][0], proposals[i][1], i))[:count]
        # a node's place: depth, then its parent's place, then its rank (parents are placed before their children)
        place: dict[int, int] = {-1: 0}
        for i in sorted(chosen, key=lambda i: (proposals[i][1], proposals[i][2], proposals[i][3])):
            place[i] = len(place)
        order = sorted(chosen, key=place.__getitem__)
        parents = (-1, *(place[proposals[i][2]] for i in order))
        if any(p >= node for node, p in enumerate(parents) if node):
            raise AssertionError("a drawn tree's parents must precede their children")
        return cls(parents, (0, *(proposals[i][1] for i in order)), (0, *(proposals[i][3] for i in order)))

    @property
    def nodes(self) -> int:
        """Draft nodes after the root."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        """``node``'s children, in draw order."""
        return [c for c, p in enumerate(self.parents) if p == node]

    @cached_property
    def hosts(self) -> list[list[int]]:
        """The nodes that draw children, by depth: ``hosts[d]`` those at depth d (``hosts[0]`` is the root)."""
        by_depth: list[list[int]] = [[] for _ in range(self.depth)]
        for node in range(len(self.parents)):
            if self.depths[node] < self.depth and self.children(node):
                by_depth[self.depths[node]].append(node)
        return by_depth

    @property
    def draws(self) -> int:
        """Rows of drafter distributions a round draws from (one per host): each needs a uniform per draft token."""
        return sum(len(level) for level in self.hosts)

    @cached_property
    def siblings(self) -> int:
        """The most children any node draws."""
        return max(len(self.children(node)) for level in self.hosts for node in level)

    def noise_uniforms(self, draft_vocab: int) -> int:
        """The uniforms a round draws its children at: a row of Gumbel noise per host (the coins come after them)."""
        return self.draws * draft_vocab


def draw_without_replacement(probs: torch.Tensor, uniforms: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` tokens drawn one after another without replacement from each row of ``probs`` [rows, V] (need not sum to
    1), at ``uniforms`` [rows, V] in [0, 1) → [rows, k] in the order drawn: the k largest of log probs + Gumbel noise.
    A row with fewer than k tokens of mass fills the rest with tokens of none."""
    noise = -torch.log(-torch.log(uniforms.clamp(min=1e-30)))  # Gumbel; a uniform of 0 stays finite
    return largest(torch.log(probs) + noise, k)[1]


class Level(NamedTuple):
    """One depth's drafter pass and draws, as constants on the device."""

    hosts: torch.Tensor  # the nodes at this depth that draw children [h]
    parent_rows: torch.Tensor  # each host's parent's row in the previous pass's output [h]
    drawn: int  # children drawn per host (the most any of them keeps)
    picks: torch.Tensor  # which draws are nodes: row·drawn + rank, in node order
    first: int  # the first of those nodes
    window: torch.Tensor  # the pass's mask over the speculative entries written before it and its own [h, written + h]


class DrawnTree:
    """A :class:`DrawnTreeShape`'s constants on the device, and :meth:`draw`, one round's drawn tree."""

    def __init__(self, shape: DrawnTreeShape, device: torch.device):
        self.shape = shape
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.parents, self.depths = as_tensor(shape.parents), as_tensor(shape.depths)
        self.levels: list[Level] = []  # per depth with hosts
        self.hosts = as_tensor([h for level in shape.hosts for h in level])
        sees = ancestor_mask(torch.tensor(shape.parents))  # [node, node]: itself and its ancestors
        passes: list[int] = []  # the hosts run so far, in the order their drafter entries were written
        for depth, hosts in enumerate(shape.hosts):
            if not hosts:
                continue
            drawn = max(len(shape.children(h)) for h in hosts)
            previous = shape.hosts[depth - 1] if depth else [0]
            parent_rows = [previous.index(shape.parents[h]) if depth else 0 for h in hosts]
            picks = [row * drawn + shape.ranks[c] for row, h in enumerate(hosts) for c in shape.children(h)]
            # a host sees the entries of its ancestors that drafted before it, and itself
            window = torch.cat([sees[hosts][:, passes], torch.eye(len(hosts), dtype=torch.bool)], dim=1)
            first = shape.depths.index(depth + 1)  # nodes are ordered by depth: the children of this depth's hosts
            self.levels.append(Level(as_tensor(hosts), as_tensor(parent_rows), drawn, as_tensor(picks), first,
                                     window.to(device)))
            if depth:
                passes += hosts

    def draw(self, drafter: DraftRunner, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
             length: torch.Tensor, valid: torch.Tensor, chances, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit the target states as :func:`eyas.engine.drafting.draft_tree` does, then draw the tree level by
        level: each host's children are the largest of log q + Gumbel noise (``uniforms`` [draws·Vd], a row per host
        in host order), q = ``chances``(the drafter's logits [rows, Vd]) → (draft-vocabulary ids of nodes 1 … n [n],
        each host's q [draws, Vd], in node order)."""
        hidden, _, _, base, committed = drafter.commit(aux, next_tokens, positions, length, valid, 0)
        uniforms = uniforms.view(-1, drafter.drafter.d2t.shape[0])  # a row per host
        ids = torch.zeros(self.shape.nodes + 1, dtype=torch.long, device=drafter.device)
        rows, written, drawn_rows = [], 0, 0
        pre_norm = hidden  # the rows q is read from: the root's, then those of each pass's hosts
        for depth, (hosts, parent_rows, drawn, picks, first, window) in enumerate(self.levels):
            if depth:  # hosts at this depth run the drafter from their parents' pre-norm rows and their own tokens
                tokens = drafter.drafter.to_target_ids(ids.index_select(0, hosts)).view(1, -1)
                at = (base + depth).expand(1, len(hosts))
                pre_norm = drafter.speculate(pre_norm.index_select(1, parent_rows), tokens, at, committed, written,
                                             window, 0)[0]
                written += len(hosts)
            q = chances(drafter.logits(pre_norm))  # [hosts, Vd]
            children = draw_without_replacement(q, uniforms[drawn_rows : drawn_rows + len(hosts)], drawn)
            ids[first : first + len(picks)] = children.flatten().index_select(0, picks)  # in draw order
            rows.append(q)
            drawn_rows += len(hosts)
        return ids[1:], torch.cat(rows)
