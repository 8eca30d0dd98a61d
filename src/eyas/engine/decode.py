"""Decoding, plain or speculative (chain or EAGLE-2 tree), greedy or sampled (batch 1).

A generation is the target's prefill of the prompt, whose next token is the first one emitted, then
rounds (:mod:`eyas.engine.round`: draft → verify → accept → commit) until a stop token or the limit. Plain
decoding is the same round with nothing drafted. Rounds, greedy or sampled, run on the device in bursts
(:mod:`eyas.engine.burst`); a sampled generation's uniforms come from one generator on the device, seeded by the
request (the same seed, device and engine: the same output). Speculation never changes the output's
distribution: greedy output equals the target's greedy output token for token, sampled output follows the
target's distribution.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from eyas.engine.acceptance import Sampling, draw, target_probs
from eyas.engine.burst import Burst
from eyas.engine.modes import Speculation
from eyas.engine.round import Round
from eyas.engine.target_runner import TargetRunner

__all__ = ["Generation", "Speculation", "generate", "round_for", "warm_up"]


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


class _Output:
    """The tokens emitted so far, cut at a stop token (kept) or the limit, shown to ``on_tokens`` as they come."""

    def __init__(self, limit: int, stop: set[int], on_tokens: Callable[[list[int]], None] | None, max_depth: int):
        self.limit, self.stop, self.on_tokens = limit, stop, on_tokens
        self.generation = Generation(tokens=[], max_depth=max_depth)

    @property
    def remaining(self) -> int:
        return self.limit - len(self.generation.tokens)

    def emit(self, new: Iterable[int]) -> bool:
        """Append tokens until a stop token or the limit; True when generation is over."""
        tokens, before, done = self.generation.tokens, len(self.generation.tokens), False
        for token in new:
            tokens.append(token)
            if token in self.stop or len(tokens) >= self.limit:
                done = True
                break
        if self.on_tokens is not None:
            self.on_tokens(tokens[before:])
        return done

    def round(self, accepted: int, new: list[int]) -> bool:
        """A round's outcome: its acceptance counted (when speculating), its tokens emitted."""
        if self.generation.max_depth:
            self.generation.accepted.append(accepted)
        return self.emit(new)


@torch.no_grad()
def generate(target: TargetRunner, prompt: torch.Tensor, max_new_tokens: int, drafter=None,
             speculation: Speculation | None = None, sampling: Sampling | None = None,
             stop_ids: Iterable[int] = (), on_tokens: Callable[[list[int]], None] | None = None) -> Generation:
    """Generate after ``prompt`` [1, P]; with a drafter (its family's runner) and a :class:`Speculation`,
    speculatively. ``on_tokens`` sees every batch of emitted tokens as it is decided (for streaming)."""
    sampling = sampling or Sampling()
    generator = torch.Generator(target.device).manual_seed(sampling.seed)  # every uniform: one seed, one output
    speculating = drafter is not None and speculation is not None
    if speculating:
        sampling.check_mode(speculation.mode)
    output = _Output(max_new_tokens, set(stop_ids), on_tokens, speculation.max_depth if speculating else 0)
    # 1. the prompt: the target's prefill, whose next token is the first emitted
    logits, aux = target.prefill(prompt)
    if sampling.greedy:
        token = int(logits.argmax())
    else:
        token = int(draw(target_probs(logits, sampling), torch.rand((), generator=generator, device=target.device)))
    if output.emit([token]):
        return output.generation
    # 2. the rounds, plain or speculative, until a stop token or the limit
    decoding_round, burst = round_for(target, drafter if speculating else None, speculation if speculating else None)
    decoding_round.begin(prompt, aux, token)
    _rounds(burst, output, sampling, generator)
    return output.generation


@torch.no_grad()
def warm_up(target: TargetRunner, prompts: Iterable[torch.Tensor], decoders: Iterable[tuple], drafter=None) -> float:
    """Everything a decoder does once before it runs at speed, done now → the seconds it took: a few tokens of each
    ``(speculation or None, sampling)`` decoder (its round recorded, and with compile, compiled), then the start of a
    generation at each other prompt length: the target's prefill (each length bucket's recording) and, when a decoder
    speculates, the drafter's eager commit of the prompt (on a GPU its attention kernel prepares itself for each new
    length, tens of milliseconds: a timed prompt of a new length would pay it). Timings taken afterwards are decoding
    alone."""
    import time

    prompts, decoders = list(prompts), list(decoders)
    began = time.perf_counter()
    for speculation, sampling in decoders:
        generate(target, prompts[0], 4, drafter if speculation else None, speculation, sampling)
    speculating = next(((s, rule) for s, rule in decoders if s is not None), None) if drafter is not None else None
    seen = {prompts[0].shape[1]}
    for prompt in prompts[1:]:
        if prompt.shape[1] in seen:
            continue
        seen.add(prompt.shape[1])
        if speculating:  # the prefill, the drafter's commit of the prompt and a first round
            generate(target, prompt, 2, drafter, *speculating)
        else:
            target.prefill(prompt)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    # the compiler leaves millions of objects behind, and a full collection walking them would stall whichever decode
    # it fell in: what is alive now is frozen out of the collector's walks (vLLM does the same after recording graphs)
    gc.collect()
    gc.freeze()
    return time.perf_counter() - began


def _rounds(burst: Burst, output: _Output, sampling: Sampling, generator: torch.Generator) -> None:
    """Rounds in bursts on the device; the next burst is queued before the last one is read back (each round
    emits a token at least, so ``remaining − queued`` rounds can still be of use)."""
    burst.start(sampling, generator)
    most_in_flight = 2 if burst.pipelined else 1
    while True:
        while burst.in_flight < most_in_flight and (more := burst.rounds_that_fit(
                output.remaining - burst.queued_rounds)) > 0:
            burst.extend(more)
        if not burst.in_flight:
            raise burst.round.no_room()
        for accepted, new in burst.collect():
            if output.round(accepted, new):
                return


def round_for(target: TargetRunner, drafter, speculation: Speculation | None) -> tuple[Round, Burst]:
    """The pair's round for ``speculation`` (None: plain decoding) and its burst, made once: their recordings read
    and write these instances' buffers, so every later generation must use the same instances."""
    key = (None if drafter is None else id(drafter), None if speculation is None else speculation.label())
    made = target.rounds.get(key)
    if made is None or made[0].drafter is not drafter:
        decoding_round = Round(target, drafter, speculation)
        made = target.rounds[key] = (decoding_round, Burst(decoding_round))
    return made
