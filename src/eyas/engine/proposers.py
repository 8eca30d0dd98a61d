"""What a round drafts: one proposer per kind of draft, chosen once when a decoder is built (:mod:`eyas.engine.decoders`).

A proposer's ``propose(round, uniforms)`` reads the round's state on the device — the root, the committed lengths, the
target states accepted last round (:class:`eyas.engine.round.Round`) — and returns the round's :class:`Draft` (node 0
the root, then the proposals, each with the position the target runs it at) and, for drafts drawn from the drafter,
the distribution each was drawn from over the target's vocabulary (None for a deterministic draft). ``uniforms``
says how many of a sampled round's uniforms it consumes first (the judge reads those after them).

- :class:`NoDraft`: plain decoding, the root alone;
- :class:`GreedyChain` (EAGLE-3: one pass a draft) and :class:`BlockChain` (a block drafter: the whole chain from one
  forward): the drafter's argmax at each step;
- :class:`DrawnChain` and :class:`DrawnBlockChain`: each draft drawn from the drafter's own distribution under the
  request's temperature and top-p;
- :class:`TopKTree`: EAGLE-2's dynamic tree of the drafter's top-k (:mod:`eyas.engine.drafting`);
- :class:`DrawnTree`: a static tree shape whose children are drawn without replacement (:mod:`eyas.engine.drawn_tree`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from eyas.engine.acceptance import Sampling, draw, target_probs
from eyas.engine.drafting import draft_chain, draft_tree, draw_chain, proposal_depths
from eyas.engine.drawn_tree import DrawnTree as DrawnTreeLevels
from eyas.engine.drawn_tree import DrawnTreeShape


class Draft(NamedTuple):
    """A round's candidates: node 0 is the root; ``tokens`` [n] target ids, ``positions`` [n] where the target
    runs them; a tree's ``parents`` (root −1) and ``depths`` [n] (None for a chain: node i the child of i − 1)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None


def _drafter_inputs(r) -> tuple:
    """What an EAGLE-3 drafter reads of the round: the accepted states, the tokens after them, their positions, the
    drafter's committed length and how many of the states count."""
    state, n = r.state, r.width
    return r.aux, state.emitted.view(1, n), state.positions.view(1, n), state.drafter_length, state.valid


def _over_target_vocabulary(r, rows: torch.Tensor) -> torch.Tensor:
    """The drafter's distributions over its vocabulary [k, Vd] spread onto the target's ids [k, V] (0 elsewhere)."""
    size = r.target.layout.lm_head.weight.shape[0]
    return rows.new_zeros(len(rows), size).index_copy_(1, r.drafter.vocabulary(), rows)


def _chain_draft(r, drafts: torch.Tensor) -> Draft:
    """The root, then ``drafts``: node i runs at the committed length + i."""
    state = r.state
    return Draft(torch.cat([state.root, drafts.to(r.target.device)]), state.target_length + r.steps)


class NoDraft:
    """Plain decoding: the root alone, run at the committed length."""

    uniforms = 0

    def propose(self, r, uniforms: torch.Tensor | None) -> tuple[Draft, None]:
        return Draft(r.state.root, r.state.target_length), None


class GreedyChain:
    """``length`` drafts, each the drafter's argmax after the one before (one drafter pass a draft)."""

    uniforms = 0

    def __init__(self, length: int):
        self.length = length

    def propose(self, r, uniforms: torch.Tensor | None) -> tuple[Draft, None]:
        return _chain_draft(r, draft_chain(r.drafter, *_drafter_inputs(r), self.length)), None


class BlockChain:
    """A block drafter's ``length`` argmax proposals after the root, from one forward over its context cache (the
    accepted states committed first)."""

    uniforms = 0

    def __init__(self, length: int):
        self.length = length

    def propose(self, r, uniforms: torch.Tensor | None) -> tuple[Draft, None]:
        state, drafter = r.state, r.drafter
        drafter.commit(r.aux, state.positions.view(1, r.width))
        return _chain_draft(r, drafter.propose(state.root, state.target_length, self.length)), None


class DrawnChain:
    """``length`` drafts, each drawn from the drafter's distribution (its logits under the request's temperature and
    top-p) at ``uniforms[i]``, after the one before."""

    def __init__(self, length: int, sampling: Sampling):
        self.length, self.sampling, self.uniforms = length, sampling, length

    def propose(self, r, uniforms: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        drafter, sampling = r.drafter, self.sampling
        uniforms = uniforms.to(drafter.device)
        vocab = drafter.vocabulary()  # draft-vocabulary entry → target id
        place = iter(range(self.length))

        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            chances = target_probs(logits, sampling)
            # index_select, not vocab[token]: indexing by a 0-d tensor reads it on the host (no CUDA graph then)
            return vocab.index_select(0, draw(chances, uniforms[next(place)]).view(1)), chances

        drafts, rows = draw_chain(drafter, *_drafter_inputs(r), self.length, pick)
        return _chain_draft(r, drafts), _over_target_vocabulary(r, rows).to(r.target.device)


class DrawnBlockChain:
    """A block drafter's ``length`` proposals drawn from each slot's distribution (one forward) at ``uniforms``."""

    def __init__(self, length: int, sampling: Sampling):
        self.length, self.sampling, self.uniforms = length, sampling, length

    def propose(self, r, uniforms: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        state, drafter = r.state, r.drafter
        drafter.commit(r.aux, state.positions.view(1, r.width))
        rows = target_probs(drafter.slot_logits(state.root, state.target_length, self.length), self.sampling)
        drafts = draw(rows, uniforms.to(drafter.device))
        return _chain_draft(r, drafts), rows.to(r.target.device)


class TopKTree:
    """EAGLE-2's dynamic tree: the drafter's top ``top_k`` at each of the best nodes, ``depth`` deep, the best
    ``total`` nodes kept (:func:`eyas.engine.drafting.draft_tree`)."""

    uniforms = 0

    def __init__(self, r, top_k: int, depth: int, total: int):
        self.top_k, self.depth, self.total = top_k, depth, total
        self._proposal_depths = proposal_depths(top_k, depth, r.drafter.device)
        device = r.target.device
        self._root_parent = torch.full((1,), -1, dtype=torch.long, device=device)
        self._root_depth = torch.zeros(1, dtype=torch.long, device=device)

    def propose(self, r, uniforms: torch.Tensor | None) -> tuple[Draft, None]:
        state = r.state
        tokens, parents, depths = (part.to(r.target.device) for part in draft_tree(
            r.drafter, *_drafter_inputs(r), self.top_k, self.depth, self.total, self._proposal_depths))
        tokens = torch.cat([state.root, tokens])
        parents = torch.cat([self._root_parent, parents])
        depths = torch.cat([self._root_depth, depths])
        return Draft(tokens, state.target_length + depths, parents, depths), None


class DrawnTree:
    """A static tree shape as large as the mode's (:class:`eyas.engine.drawn_tree.DrawnTreeShape`) whose children are
    drawn from the drafter's distribution without replacement, Gumbel noise from ``uniforms`` → the draft and the
    drafter's distribution at each node with children over the target's vocabulary [hosts, V], in host order."""

    def __init__(self, r, shape: DrawnTreeShape, sampling: Sampling):
        self.sampling = sampling
        self.levels = DrawnTreeLevels(shape, r.drafter.device)
        self.uniforms = shape.noise_uniforms(len(r.drafter.drafter.d2t))
        device = r.target.device
        self.parents, self.depths = self.levels.parents.to(device), self.levels.depths.to(device)
        self.hosts = self.levels.hosts.to(device)

    @property
    def shape(self) -> DrawnTreeShape:
        return self.levels.shape

    def propose(self, r, uniforms: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        state, drafter = r.state, r.drafter
        ids, rows = self.levels.draw(drafter, *_drafter_inputs(r), lambda logits: target_probs(logits, self.sampling),
                                     uniforms.to(drafter.device))
        device = r.target.device
        tokens = torch.cat([state.root, drafter.drafter.to_target_ids(ids).to(device)])
        return Draft(tokens, state.target_length + self.depths, self.parents, self.depths), \
            _over_target_vocabulary(r, rows).to(device)
