"""Rounds in bursts: many rounds replayed on the device, one read-back.

A greedy round (:meth:`eyas.engine.round.Round.run` with the greedy decoder) reads and writes only device tensors, and
so does a sampled one given its row of uniforms, which the burst draws for all its rounds before queueing them (one kernel, from the generation's seeded generator on the device). A burst of R
rounds is R replays of one recorded function and one read-back of what they emitted. Output and τ equal
round-by-round decoding token for token: the host replays the burst's rounds from their recorded acceptance
counts and stops where a stop token or the limit falls. A burst may run past a stop token (wasted work,
never wrong output).

Bursts are pipelined: the state a burst leaves stays on the device, so the next burst is queued before the
host reads the last one back, and the GPU does not idle while the host turns one burst's outcome into
tokens. Each queued burst writes its outcome to its own half of the output buffers and has it copied to
pinned host memory as it ends; at most two are in flight.
"""

from __future__ import annotations

from collections import deque

import torch

from eyas.engine.acceptance import Sampling
from eyas.engine.round import Round

MAX_ROUNDS = {"plain": 32, "chain": 16, "tree": 8}  # a tree round emits up to depth + 1 tokens: a burst's overshoot stays small


class Burst:
    """The rounds of one :class:`Round`, greedy or sampled, queued on the device and read back a burst at a time."""

    pipelined = True  # queue the next burst before reading the last one back (False: one at a time, to compare)

    def __init__(self, round: Round):
        self.round, self.max_rounds, width = round, MAX_ROUNDS[round.mode], round.width
        device = round.target.device
        # two halves: the burst being read back and the one queued after it
        self._region = self.max_rounds * width + width
        self.out = torch.zeros(2 * self._region, dtype=torch.long, device=device)
        self.accepted = torch.zeros(2 * self.max_rounds, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(2 * self.max_rounds, round.uniforms_per_round, device=device)  # a row a round
        self.sampling = Sampling()
        self.decoder = None  # the round's proposer and judge under self.sampling (start chooses them)
        self.generator: torch.Generator | None = None
        self._region_starts = torch.tensor([[0, 0], [self._region, self.max_rounds]], device=device)
        readback = 2 + self.max_rounds + self._region  # both lengths, the acceptance counts, the tokens
        pinned = device.type == "cuda"
        self._host = [torch.empty(readback, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._queued: deque[tuple[int, int]] = deque()  # (half, rounds) of each burst not yet read back
        self._next = 0

    @property
    def queued_rounds(self) -> int:
        """Rounds queued on the device and not yet read back."""
        return sum(rounds for _, rounds in self._queued)

    @property
    def in_flight(self) -> int:
        """Bursts queued and not yet read back."""
        return len(self._queued)

    def rounds_that_fit(self, wanted: int) -> int:
        """How many rounds (≤ ``wanted``, ≤ the burst size) fit both caches after the queued ones."""
        return min(self.max_rounds, self.round.rounds_that_fit(wanted, self.queued_rounds))

    def start(self, sampling: Sampling | None = None, generator: torch.Generator | None = None) -> None:
        """Forget bursts of an earlier generation; decode its rounds under ``sampling`` (default greedy), a sampled
        round's uniforms from ``generator`` (on the round's device); record the round on first use."""
        self.sampling, self.generator = (sampling or Sampling()).resolved(self.round.mode), generator
        if not self.sampling.greedy and generator is None:
            raise ValueError("sampled rounds need a generator for their uniforms")
        self.decoder = self.round.decoder(self.sampling)  # the rule's proposer and judge, made once
        self.round.ensure_recorded((self._name(), self._replay))
        self._queued.clear()
        self._next = 0

    def _name(self) -> str | tuple:
        """The recording's name: a sampled round's bakes in its rule (everything of the sampling but the seed)."""
        return "burst" if self.sampling.greedy else ("burst", self.sampling.recorded)

    @torch.no_grad()
    def extend(self, rounds: int) -> None:
        """Queue ``rounds`` more rounds after the queued ones, from the state they leave on the device."""
        half, state = self._next, self.round.state
        self._next ^= 1
        state.output_place.copy_(self._region_starts[half])  # this burst's outcome goes to its half
        first = half * self.max_rounds
        if not self.sampling.greedy:
            self.uniforms[first : first + rounds].uniform_(generator=self.generator)
        key = self.round.key(self._name())
        for _ in range(rounds):
            self.round.target.graphs.run(key, self._replay)
        out = half * self._region
        head = torch.cat([state.lengths, self.accepted[first : first + rounds], self.out[out : out + self._region]])
        host = self._host[half][: len(head)]
        if self._copied[half] is None:
            host.copy_(head)
        else:  # into pinned memory without waiting; collect() waits for this event
            host.copy_(head, non_blocking=True)
            self._copied[half].record()
        self._queued.append((half, rounds))

    def collect(self) -> list[tuple[int, list[int]]]:
        """Read back the oldest queued burst → each round's (drafts accepted, tokens emitted); both runners'
        lengths afterwards count every round of it (the caller stops wherever the output ends)."""
        half, rounds = self._queued.popleft()
        if self._copied[half] is not None:
            self._copied[half].synchronize()
        head = self._host[half][: 2 + rounds + self._region].tolist()
        self.round.target.length = head[0]
        if self.round.drafter is not None:
            self.round.drafter.length = head[1]
        counts, tokens = head[2 : 2 + rounds], head[2 + rounds :]
        result, offset = [], 0
        for accepted in counts:
            result.append((accepted, tokens[offset : offset + accepted + 1]))
            offset += accepted + 1
        return result

    def _replay(self) -> None:
        """One round, then its outcome written to this burst's half of the output buffers."""
        state = self.round.state
        uniforms = None if self.sampling.greedy else self.uniforms.index_select(0, state.round_index)[0]
        new, accepted, emitted = self.round.run(self.decoder, uniforms)
        at = state.out_at if self.round.width == 1 else state.out_at + self.round.steps
        self.out.index_copy_(0, at, new)
        if self.round.drafter is not None:  # plain rounds accept nothing: their counts stay 0
            self.accepted.index_copy_(0, state.round_index, accepted)
        state.round_index.add_(1)
        state.out_at.add_(emitted)
