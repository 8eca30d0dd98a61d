"""One decoding round, as named steps over fixed shapes: draft → verify → accept → commit.

- draft: the drafter commits the states the target accepted last round and proposes after the root (the
  last emitted token, not yet run by the target): nothing (plain decoding), a greedy chain, or an EAGLE-2
  dynamic tree (:mod:`eyas.engine.drafting`) — or, with a block drafter, a chain in one forward
  (:mod:`eyas.engine.block_runner`);
- verify: the target runs the root and every proposal in one forward, each tree node seeing its ancestors;
- accept: which proposals the target agrees with, and its own next token after them, the bonus
  (:mod:`eyas.engine.acceptance`) — greedy, or sampled under the request's rule at uniforms drawn beforehand;
- commit: the accepted path's cache entries move to the slots after the committed ones, and the round's
  outcome becomes the next round's inputs.

A round emits accepted + 1 tokens; τ, the mean acceptance length (DESIGN "Conventions"), is their mean
over rounds. Every number a round reads or writes lives on the device (:class:`RoundState`), so a greedy
round is a function of no arguments, and a sampled round one of its row of uniforms, which a burst replays
under a CUDA graph (:mod:`eyas.engine.burst`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from eyas.engine.acceptance import (
    Sampling,
    block_sampled,
    chain_sampled,
    chain_verdict,
    draw,
    target_probs,
    tree_drawn,
    tree_sampled,
    tree_verdict,
)
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.drafting import ancestor_mask, draft_chain, draft_tree, draw_chain, proposal_depths
from eyas.engine.drawn_tree import DrawnTree, DrawnTreeShape
from eyas.engine.graphs import InputBuffer
from eyas.engine.modes import Speculation
from eyas.engine.target_runner import TargetRunner
from eyas.errors import EyasError


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


class Draft(NamedTuple):
    """A round's candidates: node 0 is the root; ``tokens`` [n] target ids, ``positions`` [n] where the target
    runs them; a tree's ``parents`` (root −1) and ``depths`` [n] (None for a chain: node i the child of i − 1)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None


class Verdict(NamedTuple):
    """What the target accepts: ``accepted`` [1] drafts, its ``bonus`` [1] token after them, and for a tree the
    accepted node at each depth ``path`` [width] (past the accepted depth: any node)."""

    accepted: torch.Tensor
    bonus: torch.Tensor
    path: torch.Tensor | None = None


class Round:
    """The round of a (target, drafter, speculation) — no drafter and no speculation: plain decoding. Made
    once per pair and mode: its recordings read and write this instance's buffers."""

    def __init__(self, target: TargetRunner, drafter: DraftRunner | None = None, speculation: Speculation | None = None):
        self.target, self.drafter, self.speculation = target, drafter, speculation
        self.mode = "plain" if speculation is None else speculation.mode
        device = target.device
        # the most tokens a round emits (its deepest path + the bonus): the states the drafter commits next round
        self.width = 1 if speculation is None else speculation.max_depth + 1
        self.state = RoundState(self.width, device)
        self.aux: torch.Tensor | None = None  # the last verify's accepted aux states [1, width, k·Ht]
        self.steps = torch.arange(self.width, device=device)
        if self.mode == "plain":
            self._one = torch.ones(1, 1, dtype=torch.long, device=device)
            self._none = torch.zeros(1, dtype=torch.long, device=device)
            self.nodes, self.target_writes, self.drafter_writes = 0, 1, 0
        else:
            self.nodes, self.target_writes, self.drafter_writes = (speculation.nodes, speculation.target_writes,
                                                                   speculation.drafter_writes)
        # a sampled round's uniforms: a chain's draws (drawn drafts), then a coin per node and the bonus's
        self.uniforms_per_round = 2 * self.nodes + 1
        if self.mode == "chain":
            k = speculation.draft_length
            self._causal = torch.ones(k + 1, k + 1, dtype=torch.long, device=device).tril()
        elif self.mode == "tree":
            top_k, depth = speculation.top_k, speculation.depth
            self._proposal_depths = proposal_depths(top_k, depth, drafter.device)
            self._root_parent = torch.full((1,), -1, dtype=torch.long, device=device)
            self._root_depth = torch.zeros(1, dtype=torch.long, device=device)
            # drawn trees: a static shape of as many nodes (eyas.engine.drawn_tree); its Gumbel rows, then the coins
            self._drawn = DrawnTree(DrawnTreeShape.best(top_k, depth, speculation.total), drafter.device)
            self._drawn_uniforms = self._drawn.shape.noise_uniforms(len(drafter.drafter.d2t))
            self.uniforms_per_round = max(self.uniforms_per_round, self._drawn_uniforms + self.nodes + 1)
            self._drawn_parents, self._drawn_depths = self._drawn.parents.to(device), self._drawn.depths.to(device)
            self._drawn_hosts = self._drawn.hosts.to(device)

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

    def draft(self) -> Draft:
        """The root and the drafter's proposals after it, from the states the target accepted last round."""
        state, n = self.state, self.width
        if self.mode == "plain":
            return Draft(state.root, state.target_length)
        drafter, spec = self.drafter, self.speculation
        inputs = (self.aux, state.emitted.view(1, n), state.positions.view(1, n), state.drafter_length, state.valid)
        if self.mode == "chain" and getattr(drafter, "blocks", False):  # a block drafter: the whole chain in one forward
            drafter.commit(self.aux, state.positions.view(1, n))
            drafts = drafter.propose(state.root, state.target_length, spec.draft_length).to(self.target.device)
            return Draft(torch.cat([state.root, drafts]), state.target_length + self.steps)
        if self.mode == "chain":
            drafts = draft_chain(drafter, *inputs, spec.draft_length).to(self.target.device)
            positions = state.target_length + self.steps  # a chain's node i runs at length + i
            return Draft(torch.cat([state.root, drafts]), positions)
        tokens, parents, depths = (part.to(self.target.device) for part in draft_tree(
            drafter, *inputs, spec.top_k, spec.depth, spec.total, self._proposal_depths))
        tokens = torch.cat([state.root, tokens])
        parents = torch.cat([self._root_parent, parents])
        depths = torch.cat([self._root_depth, depths])
        return Draft(tokens, state.target_length + depths, parents, depths)

    def verify(self, draft: Draft) -> torch.Tensor:
        """The target's logits at the root and every proposal [n, V], all in one forward."""
        if self.mode == "plain":
            tree = self._one
        else:
            tree = self._causal if self.mode == "chain" else ancestor_mask(draft.parents, self.speculation.depth)
        n = len(draft.tokens)
        return self.target.verify(self.state.target_length, draft.tokens.view(1, n), draft.positions.view(1, n), tree)[0]

    def accept(self, draft: Draft, logits: torch.Tensor) -> Verdict:
        """The greedy verdict, on the device."""
        if self.mode == "plain":
            return Verdict(self._none, logits.argmax(-1))
        if self.mode == "chain":
            return Verdict(*chain_verdict(draft.tokens[1:], logits))
        return Verdict(*tree_verdict(draft.tokens, draft.parents, draft.depths, logits, self.speculation.depth))

    def commit(self, draft: Draft, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the accepted path and set the next round's inputs → (the tokens emitted [width]: the accepted
        drafts, the bonus at index ``accepted``, then anything; how many were emitted [1])."""
        state = self.state
        if self.mode == "plain":
            state.target_length.add_(1)
            state.root.copy_(verdict.bonus)
            return verdict.bonus, self._one[0]
        length, accepted = state.target_length, verdict.accepted
        if self.mode == "tree":  # the accepted path's entries to the slots after the committed ones (read before written)
            where = length + self.steps
            self.target.move_slots(length + verdict.path, where)
            new = torch.cat([draft.tokens.index_select(0, verdict.path[1:]), verdict.bonus])
            accepted_aux = self.target.aux[:, : self.nodes + 1].index_select(1, verdict.path)
        else:  # a chain's path is a prefix: its entries are where they belong
            where = draft.positions
            new = torch.cat([draft.tokens[1:], verdict.bonus])
            accepted_aux = self.target.aux[:, : self.width]
        new.index_copy_(0, accepted, verdict.bonus)  # past the accepted drafts, placeholders
        emitted = accepted + 1
        self.aux.copy_(accepted_aux)
        state.drafter_length.add_(state.valid)  # the drafter committed the valid states (before valid changes below)
        state.emitted.copy_(new)
        state.positions.copy_(where)
        state.target_length.add_(emitted)
        state.root.copy_(new.index_select(0, accepted))
        state.valid.copy_(emitted)
        return new, emitted

    def greedy(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole greedy round: draft → verify → accept → commit → (tokens emitted [width], drafts accepted [1],
        tokens emitted [1])."""
        draft = self.draft()
        verdict = self.accept(draft, self.verify(draft))
        new, emitted = self.commit(draft, verdict)
        return new, verdict.accepted, emitted

    # ------------------------------------------------------------------ sampled rounds

    def sampled(self, sampling: Sampling, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole sampled round at ``uniforms`` [uniforms_per_round], on the device as :meth:`greedy` is: draft (the
        drafter's argmax or top-k, or a chain drawn from it) → verify → accept by ``sampling``'s rule → commit → the
        same three tensors."""
        if self.mode == "tree" and sampling.draft_sampling == "probabilistic":
            used = self._drawn_uniforms
            (draft, draft_probs), uniforms = self.draw_tree(sampling, uniforms[:used]), uniforms[used:]
        elif self.mode == "chain" and sampling.draft_sampling == "probabilistic":
            k = self.speculation.draft_length
            (draft, draft_probs), uniforms = self.draw(sampling, uniforms[:k]), uniforms[k:]
        else:
            draft, draft_probs = self.draft(), None
        verdict = self.judge(draft, target_probs(self.verify(draft), sampling), draft_probs, sampling, uniforms)
        new, emitted = self.commit(draft, verdict)
        return new, verdict.accepted, emitted

    def draw(self, sampling: Sampling, uniforms: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        """A chain drawn from the drafter's own distribution (its logits under the request's temperature and top-p),
        draft i at ``uniforms[i]`` → (the draft, the distribution each draft was drawn from [k, V])."""
        state, n, drafter, k = self.state, self.width, self.drafter, self.speculation.draft_length
        uniforms = uniforms.to(drafter.device)
        if getattr(drafter, "blocks", False):  # a block drafter: every slot's distribution from one forward
            drafter.commit(self.aux, state.positions.view(1, n))
            rows = target_probs(drafter.slot_logits(state.root, state.target_length, k), sampling)
            drafts = draw(rows, uniforms)
        else:
            vocab = drafter.vocabulary()  # draft-vocabulary entry → target id
            place = iter(range(k))

            def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                chances = target_probs(logits, sampling)
                # index_select, not vocab[token]: indexing by a 0-d tensor reads it on the host (no CUDA graph then)
                return vocab.index_select(0, draw(chances, uniforms[next(place)]).view(1)), chances

            drafts, rows = draw_chain(drafter, self.aux, state.emitted.view(1, n), state.positions.view(1, n),
                                      state.drafter_length, state.valid, k, pick)
            rows = self._over_target_vocabulary(rows)
        device = self.target.device
        return Draft(torch.cat([state.root, drafts.to(device)]), state.target_length + self.steps), rows.to(device)

    def draw_tree(self, sampling: Sampling, uniforms: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        """A tree of the static shape drawn from the drafter's own distribution (its logits under the request's
        temperature and top-p), Gumbel noise from ``uniforms`` → (the draft, the drafter's distribution at each node
        over the target's vocabulary at each node with children [hosts, V], in :attr:`DrawnTree.hosts` order)."""
        state, n, drafter, drawn = self.state, self.width, self.drafter, self._drawn
        ids, rows = drawn.draw(drafter, self.aux, state.emitted.view(1, n), state.positions.view(1, n),
                               state.drafter_length, state.valid, lambda logits: target_probs(logits, sampling),
                               uniforms.to(drafter.device))
        draft_probs = self._over_target_vocabulary(rows)
        device = self.target.device
        tokens = torch.cat([state.root, drafter.drafter.to_target_ids(ids).to(device)])
        depths = self._drawn_depths
        return Draft(tokens, state.target_length + depths, self._drawn_parents, depths), draft_probs.to(device)

    def _over_target_vocabulary(self, rows: torch.Tensor) -> torch.Tensor:
        """The drafter's distributions over its vocabulary [k, Vd] spread onto the target's ids [k, V] (0 elsewhere)."""
        size = self.target.layout.lm_head.weight.shape[0]
        return rows.new_zeros(len(rows), size).index_copy_(1, self.drafter.vocabulary(), rows)

    def judge(self, draft: Draft, probs: torch.Tensor, draft_probs: torch.Tensor | None, sampling: Sampling,
              uniforms: torch.Tensor) -> Verdict:
        """The sampled verdict on the device, from the target's distributions at every node ``probs`` [n, V] and the
        round's uniforms left after drawing (:mod:`eyas.engine.acceptance`)."""
        if self.mode == "plain":
            return Verdict(self._none, draw(probs, uniforms[:1]))
        n = len(draft.tokens)
        if self.mode == "tree" and draft_probs is not None:
            return Verdict(*tree_drawn(draft.tokens, draft.parents, draft.depths, probs, self._drawn_hosts, draft_probs,
                                       uniforms[:n], self.speculation.depth, self._drawn.shape.siblings))
        if self.mode == "tree":
            return Verdict(*tree_sampled(draft.tokens, draft.parents, draft.depths, probs, uniforms[:n],
                                         self.speculation.depth))
        rule = block_sampled if sampling.verification == "block" else chain_sampled
        return Verdict(*rule(draft.tokens[1:], probs, draft_probs, uniforms[:n]))

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
