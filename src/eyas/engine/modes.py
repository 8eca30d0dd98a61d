"""The cache slots a decoding mode needs, and the modes a drafter can run.

The caches ``eyas bench`` and ``eyas generate`` allocate are sized here, from the modes they run: the target's to the
prompt, the answer and one round's drafts; the drafter's larger, by what its rounds write beyond the target's. The
modes themselves (:class:`Speculation`, how ``--mode`` spells one) and the sampling rules' names live in the torch-free
:mod:`eyas.speculation`, re-exported here. Nothing here imports torch either.
"""

from __future__ import annotations

from collections.abc import Iterable

from eyas.errors import EyasError
from eyas.speculation import (  # noqa: F401  re-exported: the engine's importers name them here
    DRAFT_SAMPLING,
    DRAWN_TREES_FROM,
    MODE_SPELLING,
    VERIFICATION,
    ModeError,
    Speculation,
    parse_mode,
    parse_modes,
    tree_size,
)

DRAFTER_SPARE = 16  # the drafter's cache beyond the target's, at least: max depth + 1 of any mode up to depth 15


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
