"""Greedy chain rounds in bursts (:mod:`eyas.engine.round_burst`): k greedy drafts, the target verifies
the root and the k drafts at the k + 1 slots after its committed ones."""

from __future__ import annotations

import torch

from eyas.engine.draft_runner import DraftRunner
from eyas.engine.round_burst import RoundBurst
from eyas.engine.target_runner import TargetRunner
from eyas.engine.verify import chain_verdict


class ChainBurst(RoundBurst):
    """Device-resident greedy chain rounds of ``k`` drafts."""

    def __init__(self, target: TargetRunner, drafter: DraftRunner, k: int):
        # the drafter commits k + 1 states, then writes k − 1 drafts after the valid ones
        super().__init__(target, drafter, width=k + 1, target_writes=k + 1, drafter_writes=2 * k)
        self.k = k
        self._causal = torch.ones(k + 1, k + 1, dtype=torch.long, device=target.device).tril()

    def _round(self) -> None:
        n, k = self.width, self.k
        t_len, d_len, root, valid, emitted, positions = self._state()
        # The drafter: commit the last verify's states (each with the token after it), draft from the last valid one.
        drafts = self.drafter.chain_on_device(self.aux, emitted.view(1, n), positions.view(1, n), d_len, valid, k)
        drafts = drafts.to(self.target.device)
        # The target: verify root + drafts at the positions after its committed ones (a chain's slots).
        where = t_len + self._steps
        logits = self.target._static_step(t_len, torch.cat([root, drafts]).view(1, n), where.view(1, n), self._causal)
        accepted, bonus = chain_verdict(drafts, logits[0])
        new = torch.cat([drafts, bonus])  # placeholder last, then the bonus written at its place
        new.index_copy_(0, accepted, bonus)
        self._advance(new, where, accepted, self.target._aux[:, :n])
