"""Greedy EAGLE-2 tree rounds in bursts (:mod:`eyas.engine.round_burst`).

A round on the device, every shape fixed: the drafter commits the last round's accepted states and
grows the dynamic tree (:func:`eyas.engine.tree.grow`, one drafter pass per level), the best
``total`` proposals are selected and their ancestor mask built; the target verifies root + nodes,
:func:`eyas.engine.verify.tree_verdict` finds the accepted path, and its keys, values and aux states
are copied down to the slots after the committed ones. The host-driven round does the same with a
few synchronisations per round (the chosen nodes, the verdict); here there are none until the
burst's read-back.
"""

from __future__ import annotations

import torch

from eyas.engine.draft_runner import DraftRunner
from eyas.engine.round_burst import RoundBurst
from eyas.engine.target_runner import TargetRunner
from eyas.engine.tree import ancestor_mask, grow, proposal_depths, select
from eyas.engine.verify import tree_verdict


class TreeBurst(RoundBurst):
    """Device-resident greedy tree rounds: ``top_k`` children per node, ``depth`` levels, ``total`` nodes."""

    max_rounds = 8  # a round emits up to depth + 1 tokens: this keeps a burst's overshoot near a chain burst's

    def __init__(self, target: TargetRunner, drafter: DraftRunner, top_k: int, depth: int, total: int):
        self.top_k, self.depth = top_k, depth
        self.nodes = min(total, top_k + (depth - 1) * top_k * top_k)  # draft nodes verified each round
        # the target verifies root + nodes; the drafter commits depth + 1 states, then (depth − 1)·top_k entries
        super().__init__(target, drafter, width=depth + 1, target_writes=self.nodes + 1,
                         drafter_writes=depth + 1 + (depth - 1) * top_k)
        self._depths = proposal_depths(top_k, depth, drafter.device)
        self._root_parent = torch.full((1,), -1, dtype=torch.long, device=target.device)
        self._root_depth = torch.zeros(1, dtype=torch.long, device=target.device)

    def _round(self) -> None:
        n, top_k, depth = self.width, self.top_k, self.depth
        target, drafter = self.target, self.drafter
        t_len, d_len, root, valid, emitted, positions = self._state()
        # The drafter: commit the last round's states, grow the tree from the last valid one.
        hidden, scores, ids, base, committed = drafter.commit_on_device(self.aux, emitted.view(1, n), positions.view(1, n),
                                                                       d_len, valid, top_k)

        def run_level(frontier_hidden, tokens, level, window):  # depth level − 1 nodes run at base + level − 1
            return drafter.speculate_on_device(frontier_hidden, tokens, (base + level - 1).expand(1, top_k), committed,
                                               (level - 2) * top_k, window, top_k)

        d2t = drafter.drafter.d2t
        flat = grow(hidden, scores[0], ids[0], d2t, top_k, depth, run_level)
        tokens, parents, depths = (part.to(target.device) for part in select(*flat, self._depths, d2t, self.nodes))
        tokens = torch.cat([root, tokens])
        parents = torch.cat([self._root_parent, parents])
        depths = torch.cat([self._root_depth, depths])
        # The target: root + nodes at the slots after its committed ones, each at position length + depth.
        logits = target._static_step(t_len, tokens.view(1, -1), (t_len + depths).view(1, -1), ancestor_mask(parents, depth))
        accepted, bonus, path = tree_verdict(tokens, parents, depths, logits[0], depth)
        # Compact: the accepted path's entries to the slots after the committed ones (copied out before written).
        where = t_len + self._steps
        target.move_slots(t_len + path, where)
        new = torch.cat([tokens.index_select(0, path[1:]), bonus])  # past the accepted ones, placeholders
        new.index_copy_(0, accepted, bonus)
        self._advance(new, where, accepted, target._aux[:, : self.nodes + 1].index_select(1, path))
