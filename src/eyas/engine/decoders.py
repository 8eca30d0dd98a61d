"""A decoder: the proposer and the judge a round runs, chosen once for a (round, sampling rule) pair.

The round (:mod:`eyas.engine.round`) calls draft → verify → judge → commit and asks nothing of modes or rules: this is
where the mode (:class:`eyas.speculation.Chain` or :class:`~eyas.speculation.Tree`, or none: plain decoding), the
drafter's kind (one token a pass, or a block drafter's whole chain in one forward) and the request's sampling rule
(:class:`eyas.speculation.Sampling`, resolved for the mode) pick a proposer (:mod:`eyas.engine.proposers`) and a judge
(:mod:`eyas.engine.judges`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from eyas.engine.acceptance import Sampling, block_sampled, chain_sampled
from eyas.engine.drawn_tree import DrawnTreeShape
from eyas.engine.judges import ChainGreedy, ChainSampled, PlainGreedy, PlainSampled, TreeDrawn, TreeGreedy, TreeSampled
from eyas.engine.proposers import BlockChain, DrawnBlockChain, DrawnChain, DrawnTree, GreedyChain, NoDraft, TopKTree
from eyas.speculation import Tree


class Decoder(NamedTuple):
    """What one round drafts (``proposer``) and how it judges the draft (``judge``)."""

    proposer: Any
    judge: Any


def decoder_for(r, sampling: Sampling) -> Decoder:
    """The decoder of round ``r`` under ``sampling`` (already resolved for the round's mode)."""
    spec, device = r.speculation, r.target.device
    if spec is None:
        return Decoder(NoDraft(), PlainGreedy(device) if sampling.greedy else PlainSampled(sampling, device))
    drawn = not sampling.greedy and sampling.draft_sampling == "probabilistic"
    if isinstance(spec, Tree):
        if drawn:
            proposer = DrawnTree(r, DrawnTreeShape.best(spec.top_k, spec.depth, spec.total), sampling)
            return Decoder(proposer, TreeDrawn(sampling, spec.depth, proposer))
        judge = TreeGreedy(spec.depth) if sampling.greedy else TreeSampled(sampling, spec.depth)
        return Decoder(TopKTree(r, spec.top_k, spec.depth, spec.total), judge)
    blocks = getattr(r.drafter, "blocks", False)  # a block drafter proposes the whole chain from one forward
    k = spec.draft_length
    if drawn:
        proposer = DrawnBlockChain(k, sampling) if blocks else DrawnChain(k, sampling)
    else:
        proposer = BlockChain(k) if blocks else GreedyChain(k)
    if sampling.greedy:
        return Decoder(proposer, ChainGreedy())
    return Decoder(proposer, ChainSampled(sampling, block_sampled if sampling.verification == "block" else chain_sampled))


def uniforms_per_round(speculation, nodes: int, draft_vocab_size: int | None) -> int:
    """The most uniforms any sampled decoder of a round draws: a chain's draws (drawn drafts), then a coin per node
    and the bonus's; a drawn tree's Gumbel rows, then its coins."""
    most = 2 * nodes + 1
    if isinstance(speculation, Tree) and draft_vocab_size:
        shape = DrawnTreeShape.best(speculation.top_k, speculation.depth, speculation.total)
        most = max(most, shape.noise_uniforms(draft_vocab_size) + nodes + 1)
    return most
