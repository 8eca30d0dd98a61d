"""The DSpark drafter's side of a round: one backbone forward over a context cache, then the Markov head slot by slot.

The context cache is DFlash's (:mod:`eyas.families.dflash.runner`): one row per position the target has run, each
layer's keys and values computed once when the target's states arrive (*commit*) and kept by position. A round drafts
as vLLM's DSpark speculator does: the block at the root's position — the root (the last emitted token) and B − 1 mask
tokens — runs through every layer in one forward (:meth:`eyas.families.dflash.model.DFlashDrafter.block_hidden`, the
code training runs), giving every slot's backbone logits; then slot j's logits are those plus the Markov bias of the
token drafted before it (the root's for slot 0), and the token is chosen — the argmax, or a draw — before slot j + 1.

That second stage is a chain of one-token steps, so the runner offers what the engine's one-token-a-step proposers
ask of a drafter (:mod:`eyas.engine.drafting`: ``commit`` then ``speculate`` per further draft, ``logits``,
``vocabulary``): ``commit`` writes the accepted states, runs the block and returns slot 0's logits; ``speculate``
returns slot j's after the token drafted last. Greedy and drawn chains both run through them, and a drawn chain is
judged against the very distribution each draft was drawn from (the one its Markov bias made). Every number is a device
tensor, the block's mask is built on the device and attention spans the whole cache: a round is recorded as one CUDA
graph, as the other families' are. A prompt's states are committed eagerly, once per generation.

A DSpark drafter proposes one chain of up to B tokens a round: :func:`check_spark_modes` refuses any other mode.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from eyas.engine.topk import largest
from eyas.errors import EyasError
from eyas.families.dflash.runner import BlockDraftRunner
from eyas.families.dspark.model import DSparkDrafter
from eyas.speculation import Speculation


class SparkRunner:
    """A :class:`DSparkDrafter` with a context cache of ``capacity`` positions (batch 1), drafting with the target's
    embedding weight and lm_head module. The cache, its commits and the committed length are DFlash's block runner's
    (the same backbone): this runner asks it for them."""

    def __init__(self, drafter: DSparkDrafter, embed: torch.Tensor, lm_head: nn.Module, capacity: int):
        self.drafter, self.capacity = drafter, capacity
        self.context = BlockDraftRunner(drafter, embed, lm_head, capacity)
        self.config = config = drafter.config
        self.device, self.dtype, self.embed = self.context.device, self.context.dtype, self.context.embed
        # the target's lm_head as the context runner readied it (on a CPU prepacked for oneDNN): one copy, not two
        self._head = self.context._head
        self._slots = torch.arange(capacity, device=self.device)
        self._offsets = torch.arange(config.block_size, device=self.device)
        self._own = torch.ones(config.block_size, dtype=torch.bool, device=self.device)
        self._mask_tokens = torch.full((config.block_size - 1,), config.mask_token_id, device=self.device)
        self._base: torch.Tensor | None = None  # the round's backbone logits, one row per slot [B, V]

    @property
    def length(self) -> int:
        """Committed positions, as the host last saw them."""
        return self.context.length

    @length.setter
    def length(self, value: int) -> None:
        self.context.length = value

    @property
    def layer_ids(self) -> list[int]:
        """The target's taps the drafter reads (eyas ids): the target runner captures these."""
        return self.config.layer_ids

    def reset(self) -> None:
        """Forget every committed position (a new prompt)."""
        self.context.reset()

    def commit_prompt(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Commit a prompt's target states ``aux`` [1, n, A·Ht] at ``positions`` [1, n], eagerly."""
        self.context.commit_prompt(aux, next_tokens, positions)

    def backbone_logits(self, root: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The block at position ``anchor`` [1] holding ``root`` [1]: every slot's backbone logits [B, V], in one
        forward over the cache's positions before ``anchor`` and the block itself."""
        tokens = torch.cat([root, self._mask_tokens]).view(1, -1)
        positions = (anchor + self._offsets).view(1, -1)
        mask = torch.cat([self._slots < anchor, self._own]).expand(self.config.block_size, -1)
        hidden = self.drafter.block_hidden(F.embedding(tokens, self.embed), positions, self.context.cache, mask)
        return self._head(hidden)[0]

    def step_logits(self, slot: int, previous: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s logits [1, V] after the token ``previous`` (a target id, [1]): the backbone's plus the Markov
        bias."""
        return self._base[slot : slot + 1] + self.drafter.markov_head(previous.view(1)).to(self._base.dtype)

    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, length: torch.Tensor,
               valid: torch.Tensor, top_k: int):
        """Commit the target states ``aux`` [1, n, A·Ht] at ``positions`` [1, n] (the first ``valid`` [1] count), run
        the block after the last valid one — its root the token after it, ``next_tokens``' — and return slot 0's
        (logits [1, 1, V], top-k log-probs [1, top_k], ids [1, top_k], the last valid state's position [1, 1]) and the
        committed length after it [1] (the engine's one-token-a-step drafter interface)."""
        self.context.commit(aux, positions)
        last = valid - 1
        root = next_tokens[0].index_select(0, last)
        position = positions[0].index_select(0, last)
        self._base = self.backbone_logits(root, position + 1)
        logits = self.step_logits(0, root)
        scores, ids = self._top(logits, top_k)
        return logits[None], scores, ids, position.view(1, 1), length + valid

    def speculate(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, committed: torch.Tensor,
                  written: int, window: torch.Tensor, top_k: int):
        """The next slot after ``written`` + 1 drafted ones, after the last of them ``token_ids`` [1, 1] → (its logits
        [1, 1, V], top-k log-probs, ids)."""
        logits = self.step_logits(written + 1, token_ids)
        scores, ids = self._top(logits, top_k)
        return logits[None], scores, ids

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """A step's logits over the vocabulary [1, V] (what :meth:`commit` and :meth:`speculate` hand back)."""
        return prenorm[0]

    def vocabulary(self) -> torch.Tensor:
        """The target id of each vocabulary entry [V]: the target's own."""
        return torch.arange(self.config.vocab_size, device=self.device)

    @staticmethod
    def _top(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not top_k:
            return None, None
        best, ids = largest(logits, top_k)
        return best.float() - torch.logsumexp(logits.float(), -1, keepdim=True), ids


def check_spark_modes(modes: Iterable[Speculation], block_size: int, where: str) -> None:
    """A DSpark drafter proposes one chain of up to B tokens a round: refuse a tree or a longer chain."""
    for mode in modes:
        if mode.mode != "chain" or mode.draft_length > block_size:
            raise EyasError(f"--mode {mode.label()}: {where} is a DSpark drafter (block {block_size}), which proposes "
                            f"one chain of up to {block_size} tokens a round: use chain:K with K ≤ {block_size} "
                            f"(chain:{block_size}: the whole block)")
