"""Greedy speculation in bursts: many rounds on the device, one read-back.

A round is draft → verify root + drafts → accept; the next round's shapes depend on how many drafts
were accepted, which is why a host-driven round must tell the host. In a burst every round has one
fixed shape instead: the drafter commits all depth + 1 states the last round could have accepted
(only the first ``valid`` count; the keys past them are overwritten before anything reads them),
drafts from the last valid one, and the target verifies at positions it holds on the device.
Accepted count, bonus token, cache lengths and output offsets stay on the device, so a burst of R
rounds is R replays of one recorded function and one read-back of what they emitted.

Output and τ equal the round-by-round path token for token: the host replays the burst's rounds
from their recorded acceptance counts and stops where a stop token or the limit falls. A burst may
run past a stop token (wasted work, never wrong output).

Bursts are pipelined: the state a burst leaves (lengths, root, the accepted aux states) stays on the
device, so the next burst can be queued before the host reads the last one back, and the GPU does
not idle while the host turns one burst's outcome into tokens. Each queued burst writes its outcome
to its own half of the output buffers and has it copied to pinned host memory as it ends; at most two
are in flight.
"""

from __future__ import annotations

from collections import deque

import torch

from eyas.engine.draft_runner import DraftRunner
from eyas.engine.graphs import InputBuffer
from eyas.engine.target_runner import TargetRunner


class RoundBurst:
    """Device-resident greedy rounds for one (target, drafter) pair; a subclass says what a round is.

    ``width``: the most tokens a round emits (its deepest path + the bonus), which is also how many
    states the drafter commits at the start of the next. ``target_writes`` / ``drafter_writes``: the
    most cache slots one round writes past each runner's committed length."""

    max_rounds = 16
    pipelined = True  # queue the next burst before reading the last one back (False: one at a time, to compare)

    def __init__(self, target: TargetRunner, drafter: DraftRunner, width: int, target_writes: int, drafter_writes: int):
        self.target, self.drafter, self.width = target, drafter, width
        self.target_writes, self.drafter_writes = target_writes, drafter_writes
        device = target.device
        # [target length, drafter length, root, valid, out position, round] + emitted [width] + positions [width]
        self.numbers = InputBuffer((6 + 2 * width,), torch.long, device)
        self.aux = None  # the last verify's accepted aux states [1, width, k·Ht], the drafter's next input
        # two halves: the burst being read back and the one queued after it
        self._region = self.max_rounds * width + width
        self.out = torch.zeros(2 * self._region, dtype=torch.long, device=device)
        self.accepted = torch.zeros(2 * self.max_rounds, dtype=torch.long, device=device)
        self._region_starts = torch.tensor([[0, 0], [self._region, self.max_rounds]], device=device)
        self._steps = torch.arange(width, device=device)
        readback = 5 + self.max_rounds + self._region
        pinned = device.type == "cuda"
        self._host = [torch.empty(readback, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._queued: deque[tuple[int, int]] = deque()  # (half, rounds) of each burst not yet read back
        self._next = 0

    @property
    def queued_rounds(self) -> int:
        """Rounds queued on the device and not yet read back."""
        return sum(rounds for _, rounds in self._queued)

    def rounds_that_fit(self, wanted: int) -> int:
        """How many rounds (≤ ``wanted``, ≤ max_rounds) fit both caches after the queued ones, even if every
        draft is accepted: the rounds before the last advance at most ``width`` slots each, the last writes
        its full reach."""
        ahead = self.queued_rounds * self.width  # the most the queued rounds advance past the lengths known here
        target_room = self.target.capacity - self.target.length - ahead - self.target_writes
        drafter_room = self.drafter.capacity - self.drafter.length - ahead - self.drafter_writes
        fit = min(target_room, drafter_room) // self.width + 1
        return max(0, min(wanted, self.max_rounds, fit))

    @torch.no_grad()
    def start(self, rounds: int, aux: torch.Tensor, emitted: list[int], positions: list[int], root: int) -> None:
        """Queue ``rounds`` rounds after a verify whose first ``len(emitted)`` states ``aux`` [1, ≥c, k·Ht]
        (at ``positions``, followed by the tokens ``emitted``) were accepted; ``root`` is the bonus token
        not yet run by the target. Bursts of an earlier generation still queued are dropped."""
        n, valid = self.width, len(emitted)
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
        if self.target.graphs.ensure(self._key(), self._round):
            refill()  # the recording's warm-up rounds advanced the state
        self._queued.clear()
        self._next = 0
        self.extend(rounds)

    @torch.no_grad()
    def extend(self, rounds: int) -> None:
        """Queue ``rounds`` more rounds after the queued ones, from the state they leave on the device."""
        half, state = self._next, self.numbers.tensor
        self._next ^= 1
        state[4:6].copy_(self._region_starts[half])  # this burst's outcome goes to its half
        for _ in range(rounds):
            self.target.graphs.run(self._key(), self._round)
        first, out = half * self.max_rounds, half * self._region
        head = torch.cat([state[:5], self.accepted[first : first + rounds], self.out[out : out + self._region]])
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
        head = self._host[half][: 5 + rounds + self._region].tolist()
        self.target.length, self.drafter.length = head[0], head[1]
        self.drafter.rollback()
        counts, tokens = head[5 : 5 + rounds], head[5 + rounds :]
        result, offset = [], 0
        for accepted in counts:
            result.append((accepted, tokens[offset : offset + accepted + 1]))
            offset += accepted + 1
        return result

    def _key(self) -> tuple:
        return (type(self).__name__, id(self))  # the recording belongs to this instance's buffers

    def _round(self) -> None:
        """One round, every shape fixed, reading ``numbers`` and ending with :meth:`_advance`."""
        raise NotImplementedError

    def _state(self):
        """The round's inputs, views of ``numbers``: target length, drafter length, root, valid [1] each,
        the tokens after the committed states and their positions [width] each."""
        n, state = self.width, self.numbers.tensor
        return state[0:1], state[1:2], state[2:3], state[3:4], state[6 : 6 + n], state[6 + n : 6 + 2 * n]

    def _advance(self, new: torch.Tensor, where: torch.Tensor, accepted: torch.Tensor, aux: torch.Tensor) -> None:
        """Record the round (``new`` [width]: the accepted drafts, the bonus at index ``accepted``, then
        anything) and set the next one's inputs: the accepted states ``aux`` [1, width, k·Ht] at ``where``
        [width], both runners' lengths, the root."""
        state = self.numbers.tensor
        out_at, index, valid = state[4:5], state[5:6], state[3:4]
        self.out.index_copy_(0, out_at + self._steps, new)
        self.accepted.index_copy_(0, index, accepted)
        self.aux.copy_(aux)
        n = self.width
        state[1:2].add_(valid)  # the drafter committed the valid states (before valid changes below)
        state[6 : 6 + n].copy_(new)
        state[6 + n : 6 + 2 * n].copy_(where)
        state[0:1].add_(accepted + 1)
        state[2:3].copy_(new.index_select(0, accepted))
        state[3:4].copy_(accepted + 1)
        state[4:5].add_(accepted + 1)
        state[5:6].add_(1)
