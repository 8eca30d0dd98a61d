"""Greedy chain speculation in bursts: many rounds on the device, one read-back.

A round is draft k tokens → verify root + drafts → accept; the next round's shapes depend on how
many were accepted, which is why a plain round must tell the host. Here every round has one
fixed shape instead: the drafter commits all k + 1 states of the last verify (only the first
``valid`` count, keys past them are overwritten before anything reads them), drafts from the last
valid one, and the target verifies k + 1 tokens at positions it holds on the device. Accepted
count, bonus token, cache lengths and output offsets stay on the device, so a burst of R rounds
is R replays of one recorded function and one read-back of what they emitted.

Output and τ equal the round-by-round path token for token: the host replays the burst's rounds
from their recorded acceptance counts and stops where a stop token or the limit falls.
"""

from __future__ import annotations

import torch

from eyas.engine.draft_runner import DraftRunner
from eyas.engine.graphs import InputBuffer
from eyas.engine.target_runner import TargetRunner
from eyas.engine.verify import chain_verdict

MAX_ROUNDS = 16  # rounds per burst: the most a burst can overshoot a stop token


def chain_burst(target: TargetRunner, drafter: DraftRunner, k: int) -> ChainBurst:
    """The pair's burst runner, made once: its recorded round reads and writes this instance's buffers,
    so every later generation must use the same instance."""
    bursts = target.chain_bursts
    key = (id(drafter), k)
    if key not in bursts or bursts[key].drafter is not drafter:
        bursts[key] = ChainBurst(target, drafter, k)
    return bursts[key]


class ChainBurst:
    """Device-resident greedy chain rounds of ``k`` drafts for one (target, drafter) pair."""

    def __init__(self, target: TargetRunner, drafter: DraftRunner, k: int):
        self.target, self.drafter, self.k = target, drafter, k
        n, device = k + 1, target.device
        # [target length, drafter length, root, valid, out position, round] + emitted [n] + positions [n]
        self.numbers = InputBuffer((6 + 2 * n,), torch.long, device)
        self.aux = None  # the last verify's aux states [1, n, k·Ht], the drafter's next input
        self.out = torch.zeros(MAX_ROUNDS * n + n, dtype=torch.long, device=device)
        self.accepted = torch.zeros(MAX_ROUNDS, dtype=torch.long, device=device)
        self._steps = torch.arange(n, device=device)
        self._causal = torch.ones(n, n, dtype=torch.long, device=device).tril()

    def rounds_that_fit(self, wanted: int) -> int:
        """How many rounds (≤ ``wanted``, ≤ MAX_ROUNDS) fit both caches even if every draft is accepted."""
        n = self.k + 1
        room = min(self.target.capacity - self.target.length, self.drafter.capacity - self.drafter.length - self.k)
        return max(0, min(wanted, MAX_ROUNDS, room // n - 1))

    @torch.no_grad()
    def run(self, rounds: int, aux: torch.Tensor, emitted: list[int], positions: list[int], root: int
            ) -> list[tuple[int, list[int]]]:
        """Run ``rounds`` rounds after a verify whose first ``len(emitted)`` states ``aux`` [1, ≥c, k·Ht]
        (at ``positions``, followed by the tokens ``emitted``) were accepted; ``root`` is the bonus token
        not yet run by the target. Returns each round's (drafts accepted, tokens emitted); both runners'
        lengths afterwards count every round (the caller stops wherever the output ends)."""
        n, valid = self.k + 1, len(emitted)
        if self.aux is None:
            self.aux = torch.zeros(1, n, aux.shape[-1], dtype=aux.dtype, device=aux.device)
        pad = n - valid
        states = aux[:, :valid].clone()  # ``aux`` may be this burst's own buffer, which refill() clears
        start = torch.tensor([self.target.length, self.drafter.length, root, valid, 0, 0,
                              *emitted, *([0] * pad), *positions, *([positions[-1]] * pad)])

        def refill():
            self.numbers.fill(start)
            self.aux.zero_()
            self.aux[:, :valid].copy_(states)

        refill()
        key = ("chain-burst", id(self))  # the recording belongs to this instance's buffers
        if self.target.graphs.ensure(key, self._round):
            refill()  # the recording's warm-up rounds advanced the state
        for _ in range(rounds):
            self.target.graphs.run(key, self._round)
        state = self.numbers.tensor
        head = torch.cat([state[:5], self.accepted[:rounds], self.out]).tolist()  # the burst's one read-back
        self.target.length, self.drafter.length = head[0], head[1]
        self.drafter.rollback()
        counts, tokens = head[5 : 5 + rounds], head[5 + rounds :]
        result, offset = [], 0
        for accepted in counts:
            result.append((accepted, tokens[offset : offset + accepted + 1]))
            offset += accepted + 1
        return result

    def _round(self) -> None:
        """One round, every shape fixed, reading and advancing ``numbers`` in place."""
        n, k = self.k + 1, self.k
        state = self.numbers.tensor
        t_len, d_len, root, valid = state[0:1], state[1:2], state[2:3], state[3:4]
        out_at, index = state[4:5], state[5:6]
        emitted, positions = state[6 : 6 + n], state[6 + n : 6 + 2 * n]

        # The drafter: commit the last verify's states (each with the token after it), draft from the last valid one.
        drafts = self.drafter.chain_on_device(self.aux, emitted.view(1, n), positions.view(1, n), d_len, valid, k)
        drafts = drafts.to(self.target.device)

        # The target: verify root + drafts at the positions after its committed ones (a chain's slots).
        where = t_len + self._steps
        logits = self.target._static_step(t_len, torch.cat([root, drafts]).view(1, n), where.view(1, n), self._causal)
        accepted, bonus = chain_verdict(drafts, logits[0])
        new = torch.cat([drafts, bonus])  # placeholder last, then the bonus written at its place
        new.index_copy_(0, accepted, bonus)

        # Advance: outputs, lengths, the next round's inputs.
        self.out.index_copy_(0, out_at + self._steps, new)
        self.accepted.index_copy_(0, index, accepted)
        self.aux.copy_(self.target._aux[:, :n])
        state[6 : 6 + n].copy_(new)
        state[6 + n : 6 + 2 * n].copy_(where)
        state[0:1].add_(accepted + 1)
        state[1:2].add_(valid)  # the drafter committed the valid states
        state[2:3].copy_(bonus)
        state[3:4].copy_(accepted + 1)
        state[4:5].add_(accepted + 1)
        state[5:6].add_(1)
