"""One decoding round, as named steps over fixed shapes: draft → verify → judge → commit.

- draft: the decoder's proposer (:mod:`eyas.engine.proposers`) drafts after the root (the last emitted token, not yet
  run by the target) from the states the target accepted last round: nothing (plain decoding), a chain or a tree;
- verify: the target runs the root and every proposal in one forward, each node seeing its ancestors (the round's
  layout: a chain's causal mask, a tree's ancestors);
- judge: the decoder's judge (:mod:`eyas.engine.judges`) decides which proposals the target accepts and its own next
  token after them, the bonus — greedy, or sampled under the request's rule at uniforms drawn beforehand;
- commit: the accepted path's cache entries move to the slots after the committed ones (the layout's rule), and the
  round's outcome becomes the next round's inputs.

The decoder — proposer and judge — is chosen once per sampling rule (:mod:`eyas.engine.decoders`), the layout once per
mode: nothing in a round asks which mode or rule it runs. A round emits accepted + 1 tokens; τ, the mean acceptance
length (DESIGN "Conventions"), is their mean over rounds. Every number a round reads or writes lives on the device
(:class:`RoundState`), so a greedy round is a function of no arguments, and a sampled round one of its row of
uniforms, which a burst replays under a CUDA graph (:mod:`eyas.engine.burst`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eyas.engine.acceptance import Sampling
from eyas.engine.decoders import Decoder, decoder_for, uniforms_per_round
from eyas.engine.drafting import ancestor_mask
from eyas.engine.graphs import InputBuffer
from eyas.engine.judges import Verdict
from eyas.engine.modes import Speculation
from eyas.engine.proposers import Draft
from eyas.engine.target_runner import TargetRunner
from eyas.errors import EyasError
from eyas.speculation import Chain, Tree

__all__ = ["Draft", "Round", "RoundState", "Verdict"]


class RoundState:
    """A round's numbers on the device, in one int64 buffer that one host copy fills: the target's and the
    drafter's committed lengths, the root, how many of the states handed to the drafter count, where a
    burst writes the round's outcome and the round's index in its burst, then the tokens emitted last
    round and their states' positions [width] each. Each field is a view: steps read and update it in place."""

    FIELDS = ("target_length", "drafter_length", "root", "valid", "out_at", "round_index")  # lengths and output_place rely on this order

    def __init__(self, width: int, device: torch.device):
        self.width = width
        self.numbers = InputBuffer((len(self.FIELDS) + 2 * width,), torch.long, device)

    def _field(self, name: str) -> torch.Tensor:
        index = self.FIELDS.index(name)
        return self.numbers.tensor[index : index + 1]

    target_length = property(lambda self: self._field("target_length"))
    drafter_length = property(lambda self: self._field("drafter_length"))
    root = property(lambda self: self._field("root"))
    valid = property(lambda self: self._field("valid"))
    out_at = property(lambda self: self._field("out_at"))
    round_index = property(lambda self: self._field("round_index"))

    @property
    def lengths(self) -> torch.Tensor:
        """The target's and the drafter's committed lengths [2]."""
        return self.numbers.tensor[0:2]

    @property
    def output_place(self) -> torch.Tensor:
        """Where a burst writes the round's outcome and the round's index in its burst [2]."""
        return self.numbers.tensor[4:6]

    @property
    def emitted(self) -> torch.Tensor:
        """The tokens the last round emitted [width]: the token after each state handed to the drafter."""
        start = len(self.FIELDS)
        return self.numbers.tensor[start : start + self.width]

    @property
    def positions(self) -> torch.Tensor:
        """The positions of the states handed to the drafter [width]."""
        start = len(self.FIELDS) + self.width
        return self.numbers.tensor[start : start + self.width]

    def fill(self, target_length: int, drafter_length: int, root: int, emitted: list[int], positions: list[int]) -> None:
        """Start a generation: ``emitted`` tokens after states at ``positions`` (padded to the width; the first
        ``len(emitted)`` count), no outcome written yet."""
        pad = self.width - len(emitted)
        self.numbers.fill(torch.tensor([target_length, drafter_length, root, len(emitted), 0, 0, *emitted, *([0] * pad),
                                        *positions, *([positions[-1]] * pad)]))


class _Plain:
    """Plain decoding's layout: the root alone is verified and emitted."""

    def __init__(self, r: Round, speculation: None):
        self._one = torch.ones(1, 1, dtype=torch.long, device=r.target.device)

    def mask(self, draft: Draft) -> torch.Tensor:
        return self._one

    def commit(self, r: Round, draft: Draft, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
        state = r.state
        state.target_length.add_(1)
        state.root.copy_(verdict.bonus)
        return verdict.bonus, self._one[0]


class _Chain:
    """A chain's layout: node i sees nodes 0 … i; the accepted path is a prefix, its cache entries already in place."""

    def __init__(self, r: Round, speculation: Chain):
        k = speculation.draft_length
        self._causal = torch.ones(k + 1, k + 1, dtype=torch.long, device=r.target.device).tril()

    def mask(self, draft: Draft) -> torch.Tensor:
        return self._causal

    def commit(self, r: Round, draft: Draft, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
        new = torch.cat([draft.tokens[1:], verdict.bonus])
        return _keep_path(r, draft.positions, new, r.target.aux[:, : r.width], verdict)


class _Tree:
    """A tree's layout: each node sees its ancestors; the accepted path's cache entries move to the slots after the
    committed ones."""

    def __init__(self, r: Round, speculation: Tree):
        self.depth = speculation.depth

    def mask(self, draft: Draft) -> torch.Tensor:
        return ancestor_mask(draft.parents, self.depth)

    def commit(self, r: Round, draft: Draft, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
        where = r.state.target_length + r.steps
        r.target.move_slots(r.state.target_length + verdict.path, where)  # read before written
        new = torch.cat([draft.tokens.index_select(0, verdict.path[1:]), verdict.bonus])
        return _keep_path(r, where, new, r.target.aux[:, : r.nodes + 1].index_select(1, verdict.path), verdict)


def _keep_path(r: Round, where: torch.Tensor, new: torch.Tensor, accepted_aux: torch.Tensor, verdict: Verdict
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The next round's inputs from the accepted path (its tokens ``new`` after the accepted drafts, the bonus at index
    ``accepted``; their states ``accepted_aux`` and positions ``where``) → (the tokens emitted [width], how many [1])."""
    state, accepted = r.state, verdict.accepted
    new.index_copy_(0, accepted, verdict.bonus)  # past the accepted drafts, placeholders
    emitted = accepted + 1
    r.aux.copy_(accepted_aux)
    state.drafter_length.add_(state.valid)  # the drafter committed the valid states (before valid changes below)
    state.emitted.copy_(new)
    state.positions.copy_(where)
    state.target_length.add_(emitted)
    state.root.copy_(new.index_select(0, accepted))
    state.valid.copy_(emitted)
    return new, emitted


_LAYOUTS = {type(None): _Plain, Chain: _Chain, Tree: _Tree}


class Round:
    """The round of a (target, drafter, speculation) — no drafter and no speculation: plain decoding. Made
    once per pair and mode: its recordings read and write this instance's buffers."""

    def __init__(self, target: TargetRunner, drafter=None, speculation: Speculation | None = None):
        self.target, self.drafter, self.speculation = target, drafter, speculation
        self.mode = "plain" if speculation is None else speculation.mode
        device = target.device
        # the most tokens a round emits (its deepest path + the bonus): the states the drafter commits next round
        self.width = 1 if speculation is None else speculation.max_depth + 1
        self.state = RoundState(self.width, device)
        self.aux: torch.Tensor | None = None  # the last verify's accepted aux states [1, width, k·Ht]
        self.steps = torch.arange(self.width, device=device)
        self.nodes, self.target_writes, self.drafter_writes = (0, 1, 0) if speculation is None else (
            speculation.nodes, speculation.target_writes, speculation.drafter_writes)
        draft_vocab = getattr(getattr(drafter, "drafter", None), "d2t", None)
        self.uniforms_per_round = uniforms_per_round(speculation, self.nodes,
                                                     None if draft_vocab is None else len(draft_vocab))
        self.layout = _LAYOUTS[type(speculation)](self, speculation)
        self._decoders: dict[Any, Decoder] = {}

    @torch.no_grad()
    def begin(self, prompt: torch.Tensor, aux: torch.Tensor, token: int) -> None:
        """Start a generation after the target's prefill of ``prompt`` [1, P] (its aux states ``aux``), whose next
        token ``token`` was emitted: every prompt state but the last goes straight into the drafter; the first
        round commits the last one, followed by ``token``, and drafts from it."""
        length = prompt.shape[1]
        if self.drafter is not None:
            self.drafter.reset()
            if length > 1:
                self.drafter.commit_prompt(aux[:, :-1], prompt[:, 1:], torch.arange(length - 1).unsqueeze(0))
            if self.aux is None:
                self.aux = torch.zeros(1, self.width, aux.shape[-1], dtype=aux.dtype, device=aux.device)
            self.aux.zero_()
            self.aux[:, :1].copy_(aux[:, length - 1 : length])
        drafted = 0 if self.drafter is None else self.drafter.length
        self.state.fill(length, drafted, token, [token], [length - 1])

    # ------------------------------------------------------------------ the steps

    def decoder(self, sampling: Sampling) -> Decoder:
        """The proposer and judge this round runs under ``sampling`` (resolved for the mode), made once per rule."""
        key = "greedy" if sampling.greedy else sampling.recorded
        if key not in self._decoders:
            self._decoders[key] = decoder_for(self, sampling)
        return self._decoders[key]

    def verify(self, draft: Draft) -> torch.Tensor:
        """The target's logits at the root and every proposal [n, V], all in one forward."""
        n = len(draft.tokens)
        return self.target.verify(self.state.target_length, draft.tokens.view(1, n), draft.positions.view(1, n),
                                  self.layout.mask(draft))[0]

    def commit(self, draft: Draft, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the accepted path and set the next round's inputs → (the tokens emitted [width]: the accepted
        drafts, the bonus at index ``accepted``, then anything; how many were emitted [1])."""
        return self.layout.commit(self, draft, verdict)

    def run(self, decoder: Decoder, uniforms: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole round on the device: draft → verify → judge → commit → (tokens emitted [width], drafts accepted
        [1], tokens emitted [1]). ``uniforms`` [uniforms_per_round]: a sampled round's, the proposer's first."""
        used = decoder.proposer.uniforms
        drafting, judging = (None, None) if uniforms is None else (uniforms[:used], uniforms[used:])
        draft, draft_probs = decoder.proposer.propose(self, drafting)
        verdict = decoder.judge.judge(self, draft, self.verify(draft), draft_probs, judging)
        new, emitted = self.commit(draft, verdict)
        return new, verdict.accepted, emitted

    # ------------------------------------------------------------------ bookkeeping

    def rounds_that_fit(self, wanted: int, queued: int = 0) -> int:
        """How many rounds (≤ ``wanted``) fit both caches after ``queued`` ones not yet read back, even if every
        draft is accepted: the rounds before the last advance at most ``width`` slots each, the last writes its
        full reach."""
        ahead = queued * self.width  # the most the queued rounds advance past the lengths known here
        room = self.target.capacity - self.target.length - ahead - self.target_writes
        if self.drafter is not None:
            room = min(room, self.drafter.capacity - self.drafter.length - ahead - self.drafter_writes)
        return max(0, min(wanted, room // self.width + 1))

    def no_room(self) -> EyasError:
        """The error for a generation that needs more cache than the runners hold."""
        return EyasError(f"the sequence needs more than the {self.target.capacity} cache slots the engine holds "
                         f"({self.target.length} used, a {self.mode} round writes up to {self.target_writes} more): "
                         "raise max_length (prompt + new tokens + draft tokens)")

    def key(self, name: str) -> tuple:
        """The graph key of this round's recording ``name``: it belongs to this instance's buffers."""
        return (name, self.mode, id(self))

    @torch.no_grad()
    def ensure_recorded(self, *steps: tuple[str, Callable[[], Any]]) -> None:
        """Record each ``(name, step)`` not yet recorded, in order, each replayed once after its recording (so that
        its outputs hold real values for the next). Recording executes a step (its warm-up runs), so the state
        they advanced is put back at the end; the next round recomputes every cache entry it reads."""
        graphs = self.target.graphs
        todo = [(self.key(name), step) for name, step in steps if not graphs.has(self.key(name))]
        if not graphs.enabled or not todo:
            return
        saved = self.state.numbers.tensor.clone(), None if self.aux is None else self.aux.clone()
        for key, step in todo:
            graphs.ensure(key, step)
            graphs.run(key, step)
        self.state.numbers.tensor.copy_(saved[0])
        if saved[1] is not None:
            self.aux.copy_(saved[1])
