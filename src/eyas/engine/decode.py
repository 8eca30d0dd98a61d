"""Decoding, plain or speculative (chain or EAGLE-2 tree), greedy or sampled (batch 1).

A round: the drafter, given the target states of every token the target has accepted so far,
drafts after the target's last token (the root); the target runs the root and every draft in one
forward (a tree attends through :func:`eyas.engine.tree.ancestor_mask`); :mod:`eyas.engine.verify`
picks the accepted path and the target's own next token after it (the bonus). A round emits
accepted + 1 tokens; τ, the mean acceptance length (DESIGN "Conventions"), is their mean over
rounds — the quantity vLLM reports as 1 + accepted / drafts. Speculation never changes the output's
distribution: greedy output equals the target's greedy output token for token, sampled output
follows the target's distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from eyas.engine.chain_burst import ChainBurst
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.round_burst import RoundBurst
from eyas.engine.target_runner import TargetRunner
from eyas.engine.tree import DraftTree, ancestor_mask, chain_tree, draft_tree
from eyas.engine.tree_burst import TreeBurst
from eyas.engine.verify import Sampling, accept_chain_greedy, sample, target_probs, walk_greedy, walk_sampling


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

    def label(self) -> str:
        return f"chain:{self.draft_length}" if self.mode == "chain" else f"tree:{self.total},{self.depth},{self.top_k}"


@dataclass
class Generation:
    """New tokens (prompt excluded) and, when speculating, the drafts accepted in each round."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    max_depth: int = 0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens emitted per target verify forward (1.0 without speculation)."""
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    def accepted_at(self) -> list[float]:
        """Share of rounds whose path reached depth i + 1 (chain: whose draft i was accepted)."""
        return [sum(a > i for a in self.accepted) / max(1, self.rounds) for i in range(self.max_depth)]


def _emit(out: list[int], new: Iterable[int], max_new_tokens: int, stop: set[int]) -> bool:
    """Append tokens until a stop token (kept) or the limit; True when generation is over."""
    for token in new:
        out.append(token)
        if token in stop or len(out) >= max_new_tokens:
            return True
    return False


class _Chooser:
    """The target's next token from logits: argmax, or a sample from its (temperature, top-p) distribution.
    Distributions are computed where the logits are; the host draws only the uniforms (one seeded
    generator, so a seed gives the same draws on any device)."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(sampling.seed)

    def next_token(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(logits.argmax())
        return sample(target_probs(logits, self.sampling), self.generator)  # on the logits' device

    def walk(self, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        if self.sampling.greedy:
            return walk_greedy(tree, logits)  # the argmax on the logits' device: n ids cross, not n·V logits
        return walk_sampling(tree, target_probs(logits, self.sampling), self.generator)


def prepare_rounds(drafter: DraftRunner, speculation: Speculation, aux: torch.Tensor) -> None:
    """With static shapes, run the drafter once (on a GPU: record its graphs) in every shape a round of
    ``speculation`` can take, before the first round. A round commits 1 … max depth + 1 accepted states;
    left to decoding, each length would be recorded the first time it is accepted, in the middle of a
    timed generation (tens of milliseconds a recording, seconds when compiled). Once per mode."""
    if not drafter.static_shapes or speculation.label() in drafter.prepared_modes:
        return
    width, dtype = aux.shape[-1], aux.dtype

    def draft(count: int, start: int) -> None:
        states = torch.zeros(1, count, width, dtype=dtype)
        tokens = torch.zeros(1, count, dtype=torch.long)
        positions = torch.arange(start, start + count).unsqueeze(0)
        if speculation.mode == "chain":
            drafter.draft_chain(states, tokens, positions, speculation.draft_length)
        else:
            draft_tree(drafter, states, tokens, positions, 0, speculation.top_k, speculation.depth, speculation.total)

    for count in range(1, speculation.max_depth + 2):
        drafter.reset()
        draft(1, 0)  # a one-token prompt: committed eagerly, then the drafting steps every round shares
        draft(count, 1)  # a round's accepted states
    drafter.reset()
    drafter.prepared_modes.add(speculation.label())


def generate(target: TargetRunner, prompt: torch.Tensor, max_new_tokens: int, drafter: DraftRunner | None = None,
             speculation: Speculation | None = None, sampling: Sampling | None = None,
             stop_ids: Iterable[int] = (), on_tokens: Callable[[list[int]], None] | None = None) -> Generation:
    """Generate after ``prompt`` [1, P]; with a drafter and a :class:`Speculation`, speculatively.
    ``on_tokens`` sees every batch of emitted tokens as it is decided (for streaming)."""
    stop, chooser = set(stop_ids), _Chooser(sampling or Sampling())

    length = prompt.shape[1]
    last_logits, aux = target.prefill(prompt)
    token = chooser.next_token(last_logits)
    speculating = drafter is not None and speculation is not None
    result = Generation(tokens=[], max_depth=speculation.max_depth if speculating else 0)

    def emit(new: Iterable[int]) -> bool:
        before = len(result.tokens)
        done = _emit(result.tokens, new, max_new_tokens, stop)
        if on_tokens is not None:
            on_tokens(result.tokens[before:])
        return done

    if emit([token]):
        return result
    if not speculating and target.static_shapes and chooser.sampling.greedy:
        while True:  # bursts: the host reads tokens back every BURST steps, not after each one
            tokens = target.greedy_burst(token, min(target.BURST, max_new_tokens - len(result.tokens)))
            if emit(tokens):
                return result
            token = tokens[-1]
    if not speculating:
        while True:
            logits, _ = target.forward(torch.tensor([[token]]), torch.tensor([[target.length]]))
            target.commit(torch.tensor([0]))
            token = chooser.next_token(logits[0, -1])
            if emit([token]):
                return result
    greedy_chain = speculation.mode == "chain" and chooser.sampling.greedy
    burst = round_burst(target, drafter, speculation) if (
        chooser.sampling.greedy and target.static_shapes and drafter.static_shapes) else None
    if burst is None:  # host-driven rounds: their drafter shapes recorded up front
        prepare_rounds(drafter, speculation, aux)
    drafter.reset()
    # the drafter pairs the target state of each token with the token after it
    pending_aux, pending_tokens = aux, torch.cat([prompt[:, 1:], torch.tensor([[token]])], dim=1)
    pending_positions = torch.arange(length).unsqueeze(0)
    new = [token]
    if burst is not None and length > 1:
        # the first round is a burst's too: every prompt state but the last goes straight into the drafter
        drafter.commit(pending_aux[:, :-1], pending_tokens[:, :-1], pending_positions[:, :-1])
        pending_aux, pending_tokens, pending_positions = (t[:, -1:] for t in (pending_aux, pending_tokens, pending_positions))
    while True:
        # With static shapes, greedy rounds run on the device in bursts; the host replays each one's outcome in
        # order, so output and τ are the round-by-round ones. Host-driven rounds finish what no burst fits.
        while burst is not None and (rounds := burst.rounds_that_fit(max_new_tokens - len(result.tokens))) > 0:
            burst.start(rounds, pending_aux, new, pending_positions[0].tolist(), token)
            while True:
                # the next burst is queued before this one is read back (each round emits a token at least)
                more = burst.rounds_that_fit(max_new_tokens - len(result.tokens) - burst.queued_rounds)
                if more > 0 and burst.pipelined:
                    burst.extend(more)
                for accepted, new in burst.collect():
                    result.accepted.append(accepted)
                    if emit(new):
                        return result
                if not burst.queued_rounds:
                    break
            token, end = new[-1], target.length
            pending_aux = burst.aux[:, : len(new)]
            pending_tokens = torch.tensor([new])
            pending_positions = torch.arange(end - len(new), end).unsqueeze(0)

        start = target.length  # the root's position: emitted, not yet run by the target
        if greedy_chain:
            # drafts stay on the device: drafter, target and verdict queue back to back, one read-back a round
            drafts = drafter.draft_chain(pending_aux, pending_tokens, pending_positions, speculation.draft_length)
            positions = (start + torch.arange(len(drafts) + 1)).unsqueeze(0)
            logits, aux = target.forward(torch.tensor([[token]]), positions, drafted=drafts)
            accepted, bonus, drafted = accept_chain_greedy(drafts.to(logits.device), logits[0])
            target.commit(torch.arange(accepted + 1))
            new = [*drafted[:accepted], bonus]
            pending_aux = aux[:, : accepted + 1]  # a view of the aux buffer, read by the drafter before the next forward
        else:
            if speculation.mode == "chain":
                tree = chain_tree(token, drafter.draft_chain(pending_aux, pending_tokens, pending_positions,
                                                             speculation.draft_length))
            else:
                tree = draft_tree(drafter, pending_aux, pending_tokens, pending_positions, token, speculation.top_k,
                                  speculation.depth, speculation.total)
            mask = None if speculation.mode == "chain" else ancestor_mask(tree.parents, speculation.depth)
            logits, aux = target.forward(tree.tokens.unsqueeze(0), (start + tree.depths).unsqueeze(0), mask)
            path, bonus = chooser.walk(tree, logits[0])
            keep = torch.tensor(path)
            target.commit(keep)
            accepted, new = len(path) - 1, [*tree.tokens[keep[1:]].tolist(), bonus]
            # a chain's path is a prefix: a view of the aux buffer, read by the drafter before the next forward
            pending_aux = aux[:, : len(path)] if path[-1] == len(path) - 1 else aux[:, keep.to(aux.device)]
        result.accepted.append(accepted)
        if emit(new):
            return result
        token = bonus
        pending_tokens = torch.tensor([new])
        pending_positions = (start + torch.arange(accepted + 1)).unsqueeze(0)


def round_burst(target: TargetRunner, drafter: DraftRunner, speculation: Speculation) -> RoundBurst:
    """The pair's burst runner for ``speculation``, made once: its recorded round reads and writes this
    instance's buffers, so every later generation must use the same instance."""
    key = (id(drafter), speculation.label())
    burst = target.bursts.get(key)
    if burst is None or burst.drafter is not drafter:
        if speculation.mode == "chain":
            burst = ChainBurst(target, drafter, speculation.draft_length)
        else:
            burst = TreeBurst(target, drafter, speculation.top_k, speculation.depth, speculation.total)
        target.bursts[key] = burst
    return burst
