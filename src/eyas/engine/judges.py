"""How a round judges its draft: one judge per rule, chosen once when a decoder is built (:mod:`eyas.engine.decoders`).

A judge's ``judge(round, draft, logits, draft_probs, uniforms)`` turns the target's logits at every node into a
:class:`Verdict` on the device — the drafts accepted, the target's own token after them (the bonus), and for a tree
the accepted path — under the rules of :mod:`eyas.engine.acceptance`: greedy (the target's argmax), or sampled at
``uniforms`` (those left after the proposer's) under the request's temperature and top-p, token by token, with drafts
drawn from the drafter (``draft_probs``: their distributions), or a chain's drafts judged together (block
verification).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from eyas.engine.acceptance import (
    Sampling,
    chain_verdict,
    draw,
    target_probs,
    tree_drawn,
    tree_sampled,
    tree_verdict,
)


class Verdict(NamedTuple):
    """What the target accepts: ``accepted`` [1] drafts, its ``bonus`` [1] token after them, and for a tree the
    accepted node at each depth ``path`` [width] (past the accepted depth: any node)."""

    accepted: torch.Tensor
    bonus: torch.Tensor
    path: torch.Tensor | None = None


class PlainGreedy:
    """Plain decoding, greedy: the target's argmax."""

    def __init__(self, device: torch.device):
        self._none = torch.zeros(1, dtype=torch.long, device=device)

    def judge(self, r, draft, logits: torch.Tensor, draft_probs, uniforms) -> Verdict:
        return Verdict(self._none, logits.argmax(-1))


class PlainSampled:
    """Plain decoding, sampled: a token drawn from the target's distribution."""

    def __init__(self, sampling: Sampling, device: torch.device):
        self.sampling = sampling
        self._none = torch.zeros(1, dtype=torch.long, device=device)

    def judge(self, r, draft, logits: torch.Tensor, draft_probs, uniforms: torch.Tensor) -> Verdict:
        return Verdict(self._none, draw(target_probs(logits, self.sampling), uniforms[:1]))


class ChainGreedy:
    """A chain, greedy: the drafts up to the first that differs from the target's argmax."""

    def judge(self, r, draft, logits: torch.Tensor, draft_probs, uniforms) -> Verdict:
        return Verdict(*chain_verdict(draft.tokens[1:], logits))


class ChainSampled:
    """A chain, sampled: ``rule`` (:func:`eyas.engine.acceptance.chain_sampled`, token by token, or
    :func:`~eyas.engine.acceptance.block_sampled`, the drafts judged together) at a coin per node."""

    def __init__(self, sampling: Sampling, rule: Callable):
        self.sampling, self.rule = sampling, rule

    def judge(self, r, draft, logits: torch.Tensor, draft_probs, uniforms: torch.Tensor) -> Verdict:
        probs = target_probs(logits, self.sampling)
        return Verdict(*self.rule(draft.tokens[1:], probs, draft_probs, uniforms[: len(draft.tokens)]))


class TreeGreedy:
    """A tree, greedy: the deepest path of drafts each the target's argmax after its parent."""

    def __init__(self, depth: int):
        self.depth = depth

    def judge(self, r, draft, logits: torch.Tensor, draft_probs, uniforms) -> Verdict:
        return Verdict(*tree_verdict(draft.tokens, draft.parents, draft.depths, logits, self.depth))


class TreeSampled:
    """A tree of deterministic drafts (the drafter's top-k), sampled: each child tried in turn with the target's
    probability, the rest renormalised."""

    def __init__(self, sampling: Sampling, depth: int):
        self.sampling, self.depth = sampling, depth

    def judge(self, r, draft, logits: torch.Tensor, draft_probs, uniforms: torch.Tensor) -> Verdict:
        probs = target_probs(logits, self.sampling)
        return Verdict(*tree_sampled(draft.tokens, draft.parents, draft.depths, probs, uniforms[: len(draft.tokens)],
                                     self.depth))


class TreeDrawn:
    """A tree whose children were drawn from the drafter without replacement (``proposer``: the
    :class:`eyas.engine.proposers.DrawnTree` that drew them), sampled: min(1, p/q) child by child."""

    def __init__(self, sampling: Sampling, depth: int, proposer):
        self.sampling, self.depth, self.proposer = sampling, depth, proposer

    def judge(self, r, draft, logits: torch.Tensor, draft_probs: torch.Tensor, uniforms: torch.Tensor) -> Verdict:
        probs = target_probs(logits, self.sampling)
        return Verdict(*tree_drawn(draft.tokens, draft.parents, draft.depths, probs, self.proposer.hosts, draft_probs,
                                   uniforms[: len(draft.tokens)], self.depth, self.proposer.shape.siblings))
