"""What speculative decoding is asked to do, by name: a mode (a chain or an EAGLE-2 tree) and how ``--mode`` spells
it, the names of the sampling rules a sampled round may follow, and a request's :class:`Sampling` (temperature,
top-p, seed, rule).

``chain:K`` drafts K tokens greedily; ``tree:TOTAL,DEPTH,TOPK`` grows a dynamic tree (the EAGLE reference's is
tree:60,7,10). The rules themselves run in :mod:`eyas.engine.acceptance`; the caches a mode needs are sized in
:mod:`eyas.engine.modes`, which re-exports these names. This module is the ground floor every stage's options stand
on: it imports nothing but :mod:`eyas.errors` (no torch), so an options field can check a mode's or a rule's spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from eyas.errors import EyasError

# how a sampled round treats its drafts: the drafter's argmax (top-k in trees) or drawn from its distribution (auto:
# drawn in chains, and in trees from DRAWN_TREES_FROM); verified token by token, or a chain's drafts judged together
DRAFT_SAMPLING = ("auto", "greedy", "probabilistic")
VERIFICATION = ("standard", "block")
DRAWN_TREES_FROM = 0.85  # auto draws a tree's children from this temperature up: halfway between the two measured


def tree_size(top_k: int, depth: int, total: int) -> int:
    """Draft nodes of a dynamic tree: ``total``, or every proposal when there are fewer."""
    return min(total, top_k + (depth - 1) * top_k * top_k)


class _Round:
    """What a mode's round writes, from its ``nodes`` (draft nodes verified) — shared by :class:`Chain` and :class:`Tree`."""

    nodes: int

    @property
    def target_writes(self) -> int:
        """Target cache slots a round writes past the committed ones: the root and every node."""
        return self.nodes + 1


@dataclass(frozen=True)
class Chain(_Round):
    """``chain:K``: ``draft_length`` drafts, each the child of the one before. Its draft tokens (what the caches hold
    beyond the answer), its depth and its nodes are all K; a round writes 2K drafter slots (K + 1 states, then K − 1
    drafts after the valid ones)."""

    draft_length: int = 5
    mode: ClassVar[str] = "chain"

    draft_tokens = max_depth = nodes = property(lambda self: self.draft_length)
    drafter_writes = property(lambda self: 2 * self.draft_length)

    def label(self) -> str:
        return f"chain:{self.draft_length}"


@dataclass(frozen=True)
class Tree(_Round):
    """``tree:TOTAL,DEPTH,TOPK``: an EAGLE-2 dynamic tree of ``total`` draft tokens at most (what the caches hold
    beyond the answer), ``depth`` deep, ``top_k`` children a node."""

    total: int = 60
    depth: int = 7
    top_k: int = 10
    mode: ClassVar[str] = "tree"

    @property
    def draft_tokens(self) -> int:
        return self.total

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def nodes(self) -> int:
        """Draft nodes a round verifies (fewer than ``total`` when there are fewer proposals)."""
        return tree_size(self.top_k, self.depth, self.total)

    @property
    def drafter_writes(self) -> int:
        """Drafter cache slots a round writes past the committed ones: depth + 1 states, then (depth − 1)·top_k
        speculative entries."""
        return self.depth + 1 + (self.depth - 1) * self.top_k

    def label(self) -> str:
        return f"tree:{self.total},{self.depth},{self.top_k}"


Speculation = Chain | Tree  # what a speculative decoder drafts each round: one of the two, nothing of the other's


class ModeError(EyasError):
    """A ``--mode`` that names no mode eyas decodes; ``rule`` is what it breaks."""

    def __init__(self, text: str, rule: str):
        self.rule = rule
        super().__init__(f"mode {text!r}: {rule}")


MODE_SPELLING = "chain:K (e.g. chain:5) or tree:TOTAL,DEPTH,TOPK (e.g. tree:60,7,10), every number ≥ 1, DEPTH ≤ TOTAL"


def parse_mode(text: str) -> Speculation:
    """``chain:K`` or ``tree:TOTAL,DEPTH,TOPK`` (the EAGLE reference's tree is tree:60,7,10)."""
    kind, _, args = text.partition(":")
    try:
        numbers = [int(x) for x in args.split(",")] if args else []
        if kind == "chain" and len(numbers) == 1 and numbers[0] >= 1:
            return Chain(numbers[0])
        if kind == "tree" and len(numbers) == 3 and all(n >= 1 for n in numbers):
            total, depth, top_k = numbers
            if depth > total:  # the best TOTAL nodes hold their ancestors: no path is deeper than TOTAL
                raise ModeError(text, f"DEPTH {depth} is more than TOTAL {total}, and a tree of {total} nodes is at "
                                      f"most {total} deep: use DEPTH ≤ TOTAL")
            return Tree(total=total, depth=depth, top_k=top_k)
    except ValueError:
        pass
    raise ModeError(text, f"must be {MODE_SPELLING}")


def parse_modes(text: str) -> list[Speculation]:
    """'chain:5,tree:60,7,10' → two modes: a new one starts at each 'name:' (';' also separates); at least one."""
    modes: list[str] = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if ":" in part or not modes:
            modes.append(part)
        else:
            modes[-1] += "," + part
    parsed = [parse_mode(m) for m in modes if m]
    if not parsed:
        raise ModeError(text, f"must be one or more of {MODE_SPELLING}")
    return parsed


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_p filters the target's distribution as transformers does. With T > 0:
    ``draft_sampling`` (:data:`DRAFT_SAMPLING`) and ``verification`` (:data:`VERIFICATION`) choose the rule."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    draft_sampling: str = "auto"
    verification: str = "standard"

    def __post_init__(self):
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise EyasError(f"draft sampling {self.draft_sampling!r}: one of {', '.join(DRAFT_SAMPLING)}")
        if self.verification not in VERIFICATION:
            raise EyasError(f"verification {self.verification!r}: one of {', '.join(VERIFICATION)}")

    def resolved(self, mode: str) -> Sampling:
        """The rule a ``mode`` ("plain", "chain", "tree") runs: ``draft_sampling="auto"`` draws a chain's drafts from
        the drafter, and a tree's from :data:`DRAWN_TREES_FROM` up, below which it keeps a tree's top-k (measured,
        BENCHMARKS.md "Sampling": drawn chains accepted more at T = 1 and 0.7 on every dataset; drawn trees on every
        dataset at T = 1, on two of three at 0.7, where a dynamic tree's depth pays on code); plain decoding drafts
        nothing."""
        if self.greedy:  # no rule: the argmax everywhere
            return replace(self, draft_sampling="greedy", verification="standard")
        if self.draft_sampling != "auto":
            return self
        drawn = mode == "chain" or (mode == "tree" and self.temperature >= DRAWN_TREES_FROM)
        return replace(self, draft_sampling="probabilistic" if drawn else "greedy")

    def check_mode(self, mode: str) -> None:
        """Refuse a rule a decoding mode cannot run: block verification is a chain rule."""
        if self.greedy or mode != "tree":
            return
        if self.verification != "standard":
            raise EyasError("--verification block judges a chain's drafts together: run it with chain modes (a tree "
                            "is verified token by token)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def rule_label(self) -> str:
        """How reports name the rule beside a mode: "" (the drafter's argmax or top-k, token by token), "drawn"
        (drafts drawn from the drafter), "block" (block verification) or "drawn+block"."""
        parts = [name for name, on in (("drawn", self.draft_sampling == "probabilistic"),
                                       ("block", self.verification == "block")) if on]
        return "+".join(parts)

    @property
    def recorded(self) -> tuple:
        """What a recording of a sampled round bakes in: everything but the seed (which only picks the uniforms)."""
        return self.temperature, self.top_p, self.draft_sampling, self.verification


def chain_depths(modes: str) -> tuple[int, ...]:
    """The depths K of ``modes`` (chain:K, comma-separated), ascending; anything but chains refused in one line (what
    ``eyas train --predict-modes`` takes: τ is predicted for chains, the modes vLLM serves)."""
    chosen = parse_modes(modes)
    others = [mode.label() for mode in chosen if mode.mode != "chain"]
    if others:
        raise EyasError(f"--predict-modes {modes}: {', '.join(others)} is not a chain; τ is predicted for chains "
                        "(chain:K), the modes vLLM serves")
    return tuple(sorted({mode.max_depth for mode in chosen}))
