"""Decoding modes: a chain or an EAGLE-2 tree, how ``--mode`` spells them, and the cache slots a round of each needs.

``chain:K`` drafts K tokens greedily; ``tree:TOTAL,DEPTH,TOPK`` grows a dynamic tree (the EAGLE reference's is
tree:60,7,10). The caches ``eyas bench`` and ``eyas generate`` allocate are sized here, from the modes they run:
the target's to the prompt, the answer and one round's drafts; the drafter's larger, by what its rounds write
beyond the target's. Nothing here imports torch, so an options field can check a mode's spelling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from eyas.errors import EyasError

# how a sampled round treats its drafts (eyas.engine.acceptance has the rules): drafts the drafter's argmax (top-k in
# trees) or drawn from its distribution (auto: drawn in chains, and in trees from T = 0.85); verified token by token, or a chain's
# drafts judged together
DRAFT_SAMPLING = ("auto", "greedy", "probabilistic")
VERIFICATION = ("standard", "block")
DRAFTER_SPARE = 16  # the drafter's cache beyond the target's, at least: max depth + 1 of any mode up to depth 15


def tree_size(top_k: int, depth: int, total: int) -> int:
    """Draft nodes of a dynamic tree: ``total``, or every proposal when there are fewer."""
    return min(total, top_k + (depth - 1) * top_k * top_k)


@dataclass(frozen=True)
class Speculation:
    """``chain``: ``draft_length`` tokens; ``tree``: EAGLE-2 dynamic tree (top_k, depth, total draft tokens)."""

    mode: str = "chain"
    draft_length: int = 5
    top_k: int = 10
    depth: int = 7
    total: int = 60

    @property
    def draft_tokens(self) -> int:
        """Tokens verified after the root each round: what the caches must hold beyond the answer."""
        return self.draft_length if self.mode == "chain" else self.total

    @property
    def max_depth(self) -> int:
        return self.draft_length if self.mode == "chain" else self.depth

    @property
    def nodes(self) -> int:
        """Draft nodes a round verifies (a tree's may be fewer than ``total``)."""
        return self.draft_length if self.mode == "chain" else tree_size(self.top_k, self.depth, self.total)

    @property
    def target_writes(self) -> int:
        """Target cache slots a round writes past the committed ones: the root and every node."""
        return self.nodes + 1

    @property
    def drafter_writes(self) -> int:
        """Drafter cache slots a round writes past the committed ones: a chain commits k + 1 states, then k − 1
        drafts after the valid ones; a tree commits depth + 1 states, then (depth − 1)·top_k speculative entries."""
        if self.mode == "chain":
            return 2 * self.draft_length
        return self.depth + 1 + (self.depth - 1) * self.top_k

    def label(self) -> str:
        return f"chain:{self.draft_length}" if self.mode == "chain" else f"tree:{self.total},{self.depth},{self.top_k}"


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
            return Speculation("chain", draft_length=numbers[0])
        if kind == "tree" and len(numbers) == 3 and all(n >= 1 for n in numbers):
            total, depth, top_k = numbers
            if depth > total:  # the best TOTAL nodes hold their ancestors: no path is deeper than TOTAL
                raise ModeError(text, f"DEPTH {depth} is more than TOTAL {total}, and a tree of {total} nodes is at "
                                      f"most {total} deep: use DEPTH ≤ TOTAL")
            return Speculation("tree", total=total, depth=depth, top_k=top_k)
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


def target_capacity(prompt_tokens: int, new_tokens: int, modes: Iterable[Speculation]) -> int:
    """The target's cache: the prompt, the answer, the largest round's drafts and its root — nothing more is
    allocated (static-shape attention spans the whole cache)."""
    return prompt_tokens + new_tokens + max((m.draft_tokens for m in modes), default=0) + 1


def drafter_spare(modes: Iterable[Speculation]) -> int:
    """Slots the drafter's cache holds beyond the target's: a greedy burst commits max depth + 1 states whatever was
    accepted (without them the last rounds of a generation leave the bursts), and a round writes
    ``drafter_writes`` slots, more than the target's ``draft_tokens`` for a long chain or a wide tree."""
    return max([DRAFTER_SPARE] + [max(m.max_depth + 1, m.drafter_writes - m.draft_tokens) for m in modes])


def check_modes_fit(modes: Iterable[Speculation], draft_vocab_size: int, where: str) -> None:
    """Refuse a tree whose TOPK exceeds the drafter's vocabulary (it proposes TOPK distinct tokens a node)."""
    for mode in modes:
        if mode.mode == "tree" and mode.top_k > draft_vocab_size:
            raise EyasError(f"--mode {mode.label()}: TOPK {mode.top_k} exceeds the {draft_vocab_size}-token vocabulary of "
                            f"the drafter in {where}: use TOPK ≤ {draft_vocab_size}")


def check_block_modes(modes: Iterable[Speculation], block_size: int, where: str) -> None:
    """A block drafter proposes one chain of up to block − 1 tokens a round: refuse a tree or a longer chain."""
    for mode in modes:
        if mode.mode != "chain" or mode.draft_length > block_size - 1:
            raise EyasError(f"--mode {mode.label()}: {where} is a DFlash block drafter (block {block_size}), which proposes "
                            f"one chain of up to {block_size - 1} tokens a round: use chain:K with K ≤ {block_size - 1} "
                            f"(chain:{block_size - 1}: the whole block)")
