"""The draft vocabulary: the Vd target tokens the drafter may propose.

The drafter's lm_head has Vd rows instead of the target's V. Which tokens: the Vd most frequent
among loss-masked (assistant) positions of the training split — ties go to the lower id — sorted
ascending. Stored as engines expect: ``d2t[i] = id_i − i`` (an offset, int64, length Vd) so that
target id = draft id + d2t[draft id], and ``t2d`` a bool mask over the target vocabulary.
When Vd ≥ V the draft vocabulary is the identity (d2t all zero, t2d all true).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eyas.io import atomic_path

VOCAB_FILE = "vocab.safetensors"  # in DATA_DIR, and the copy FEATURES_DIR carries


@dataclass
class DraftVocab:
    """``d2t`` int64 [Vd] offsets, ``t2d`` bool [V], ``counts`` int64 [V] masked-token frequencies."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    counts: torch.Tensor

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, ascending: arange(Vd) + d2t."""
        return torch.arange(len(self.d2t)) + self.d2t


def count_masked_tokens(samples: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """Frequency of each token id over positions whose loss mask is 1."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        picked = np.asarray(ids)[np.asarray(mask, dtype=bool)]
        if picked.size and picked.max() >= vocab_size:
            raise ValueError(f"token id {int(picked.max())} is outside the target vocabulary of {vocab_size}")
        counts += np.bincount(picked, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top-``draft_vocab_size`` ids by count (ties: lower id), sorted ascending; identity if not smaller."""
    vocab_size = len(counts)
    if draft_vocab_size >= vocab_size:
        ids = np.arange(vocab_size)
    else:
        # lexsort sorts by the last key first: count descending, then id ascending.
        order = np.lexsort((np.arange(vocab_size), -counts))
        ids = np.sort(order[:draft_vocab_size])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    d2t = torch.from_numpy(ids - np.arange(len(ids))).to(torch.int64)
    return DraftVocab(d2t=d2t, t2d=t2d, counts=torch.from_numpy(counts.astype(np.int64)))


def save_vocab(vocab: DraftVocab, path: Path) -> None:
    """Write ``vocab.safetensors`` atomically."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d, "counts": vocab.counts}, str(tmp))


def load_vocab(path: Path) -> DraftVocab:
    """Read a ``vocab.safetensors`` written by :func:`save_vocab`."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return DraftVocab(d2t=tensors["d2t"], t2d=tensors["t2d"], counts=tensors["counts"])
