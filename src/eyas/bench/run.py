"""``eyas bench``: τ, acceptance per position and tokens/s, speculative vs plain, in one run.

Every prompt is decoded by the engine without speculation (the baseline) and then with each mode, at each
temperature (by default T = 0 and T = 1 side by side, each mode beside its own temperature's baseline),
on the same target runner, one after another, so the ratio compares like with like; with
``repeats`` > 1 the decoders take turns that many times and each prompt's median time counts. A
speedup comes with its spread over prompts: on a shared machine one figure alone can mislead. Rounds are
pooled over a dataset's prompts (τ = 1 + accepted / rounds, as vLLM reports it). At temperature 0
each speculative output is also compared with the plain one, token for token: the report says how
many matched (all of them, or something is broken). Sampled, each mode may run under several rules
(:func:`decoders`), side by side in the same run: "chain:5" is the drafter's argmax verified token by token,
"chain:5 drawn" drafts drawn from the drafter, "chain:5 block" block verification, "chain:5 drawn+block" both.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch

from eyas.data.benchmarks import Prompt
from eyas.engine.acceptance import Sampling
from eyas.engine.decode import Generation, generate, warm_up
from eyas.engine.modes import Speculation
from eyas.engine.target_runner import TargetRunner
from eyas.errors import EyasError


@dataclass
class ModeResult:
    """One dataset under one decoding mode ("plain" is the baseline)."""

    mode: str
    temperature: float = 0.0
    prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    accepted_per_position: list[float] = field(default_factory=list)
    matches_plain: int | None = None  # greedy only: outputs equal to the baseline's
    prompt_rates: list[float] = field(default_factory=list)  # each prompt's tokens/s, in prompt order (its first seed's)
    outputs: list[list[int]] = field(default_factory=list)  # each prompt's answer ids, in prompt order (its first seed's)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau, "tokens_per_second": self.tokens_per_second}


@dataclass
class BenchResult:
    """Per dataset: the baseline and each speculative mode; ``partial`` says why a run measured only some prompts."""

    datasets: dict[str, list[ModeResult]]
    settings: dict
    partial: str | None = None
    stopped_by: int = signal.SIGINT  # the signal that ended a partial run
    engines: list = field(default_factory=list)  # serving-engine levels (eyas.bench.serving.Level), when measured
    engine_notes: list[str] = field(default_factory=list)  # what the engines did not run, and why

    @property
    def exit_code(self) -> int:
        """For the command line: 128 + the signal's number when a signal ended the run (130 for Ctrl-C, 143 for
        SIGTERM), else 0."""
        return 128 + self.stopped_by if self.partial else 0


def merged_results(results: list[BenchResult]) -> BenchResult:
    """Runs over disjoint groups of prompts (each decoded with its own cache) as one result: their datasets in order,
    the first run's settings with every warm-up added, the interruption of the run that stopped, if any."""
    first, stopped = results[0], next((r for r in results if r.partial), None)
    settings = {**first.settings, "warm_up_seconds": round(sum(r.settings.get("warm_up_seconds", 0) for r in results), 1)}
    return BenchResult(datasets={k: v for r in results for k, v in r.datasets.items()}, settings=settings,
                       partial=stopped.partial if stopped else None,
                       stopped_by=stopped.stopped_by if stopped else first.stopped_by)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, ``timeout``) during a bench: handled like Ctrl-C, a partial report."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM raises :class:`Terminated` in the main thread, so the prompts measured so far are reported."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return

    def stop(number, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, call):
    """(call's result, seconds), with CUDA synchronised before and after so the GPU work is counted."""
    _synchronize(device)
    start = time.perf_counter()
    result = call()
    _synchronize(device)
    return result, time.perf_counter() - start


def decoders(modes: list[Speculation], samplings: list[Sampling]) -> list[tuple[str, Speculation | None, Sampling]]:
    """Each (label, mode, sampling) to decode, temperature by temperature (in the order of ``samplings``): the plain
    run (mode None), then every mode under every rule it can run at that temperature (a tree: any but block
    verification), labelled with the rule unless it is the default one. A mode that can run none of them: the
    error that says why."""
    chosen: list[tuple[str, Speculation | None, Sampling]] = []
    for temperature in dict.fromkeys(s.temperature for s in samplings):
        at = [s for s in samplings if s.temperature == temperature]
        chosen.append(("plain", None, at[0].resolved("plain")))
        for mode in modes:
            runnable = []
            for sampling in dict.fromkeys(s.resolved(mode.mode) for s in at):  # auto: what this mode runs
                try:
                    sampling.check_mode(mode.mode)
                except EyasError:
                    continue
                runnable.append((" ".join(filter(None, (mode.label(), sampling.rule_label))), mode, sampling))
            if not runnable:
                at[0].check_mode(mode.mode)  # raises: why this mode runs none of the rules
            chosen += runnable
    return chosen


def run_bench(target: TargetRunner, drafter, prompts: list[Prompt], modes: list[Speculation],
              samplings: list[Sampling], max_new_tokens: int, stop_ids: set[int], progress=None,
              repeats: int = 1, samples: int = 1) -> BenchResult:
    """Decode every prompt plainly and in every mode under every rule of ``samplings`` (:func:`decoders`: at each of
    their temperatures, beside that temperature's plain run; one top-p), ``repeats`` turns each, median time; sampled
    decoders ``samples`` times, at seeds seed … seed + samples − 1; pool per dataset."""
    device = target.device
    chosen = decoders(modes, samplings)
    # what is decoded for each prompt: every decoder, a sampled one at each of its seeds (pooled into its result)
    runs = [(i, k, (label, mode, rule if rule.greedy else replace(rule, seed=rule.seed + k)))
            for i, (label, mode, rule) in enumerate(chosen) for k in range(1 if rule.greedy else samples)]
    plain_at = {rule.temperature: next(n for n, run in enumerate(runs) if run[0] == i)  # its run: outputs' index
                for i, (_, mode, rule) in enumerate(chosen) if mode is None}
    datasets: dict[str, list[ModeResult]] = {}
    # warm-up, timed apart: compilation, recordings (each round's, each prompt length bucket's prefill), each prompt
    # length's first drafter commit, allocator and lazy initialisation must not land in a timed prompt
    warm_seconds = warm_up(target, [torch.tensor([p.input_ids]) for p in prompts], [(m, r) for _, m, r in chosen],
                           drafter) if prompts else 0.0
    done, partial, stopped_by = 0, None, signal.SIGINT
    try:
        with terminate_as_interrupt():
            for prompt in prompts:
                outputs, times = _decode_in_turns(target, drafter, prompt, [run for _, _, run in runs], max_new_tokens,
                                                  stop_ids, repeats)
                # a prompt counts once every decoder has decoded it: one interrupted midway is left out whole
                results = datasets.setdefault(prompt.dataset, [ModeResult(label, rule.temperature)
                                                               for label, _, rule in chosen])
                # the last turn's outputs: greedy ones are the same every turn, sampled ones share the seed
                for (index, sample, (_, mode, rule)), output, seconds in zip(runs, outputs, times, strict=True):
                    result = results[index]
                    _add(result, output, statistics.median(seconds), another_sample=sample > 0)
                    if mode is not None and rule.greedy:  # greedy: the same answer as plain decoding, token for token
                        plain = outputs[plain_at[rule.temperature]]
                        result.matches_plain = (result.matches_plain or 0) + (output.tokens == plain.tokens)
                done += 1
                if progress is not None:
                    progress(1)
    except KeyboardInterrupt as err:
        if not done:  # nothing measured: nothing to report
            raise
        stopped_by = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        how = "SIGTERM" if stopped_by == signal.SIGTERM else "Ctrl-C"
        partial = f"interrupted ({how}) after {done} of {len(prompts)} prompts"
    for results in datasets.values():
        for result in results:
            result.accepted_per_position = [x / max(1, result.rounds) for x in result.accepted_per_position]
    temperatures = list(plain_at)
    settings = {"modes": [m.label() for m in modes],
                "temperature": temperatures[0] if len(temperatures) == 1 else temperatures,
                "top_p": samplings[0].top_p, "max_new_tokens": max_new_tokens, "device": str(device), "repeats": repeats,
                "decoder": target.variant, "warm_up_seconds": round(warm_seconds, 1), "samples": samples}
    sampled = [s for s in samplings if not s.greedy]
    if sampled:  # which rules the sampled rounds ran
        settings["rules"] = list(dict.fromkeys(f"{s.draft_sampling} drafts, {s.verification} verification"
                                               for s in sampled))
    return BenchResult(datasets=datasets, settings=settings, partial=partial, stopped_by=stopped_by)


def _decode_in_turns(target: TargetRunner, drafter, prompt: Prompt,
                     chosen: list[tuple[str, Speculation | None, Sampling]], max_new_tokens: int, stop_ids: set[int],
                     repeats: int):
    """One prompt decoded by every decoder (plain ones: mode None), ``repeats`` turns: (the last turn's outputs, each
    decoder's times)."""
    ids = torch.tensor([prompt.input_ids])
    calls = [lambda mode=mode, rule=rule: generate(target, ids, max_new_tokens, drafter if mode else None, mode, rule,
                                                   stop_ids)
             for _, mode, rule in chosen]
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):  # the decoders take turns, so a slow spell of the machine hits each of them
        outputs = []
        for decoder, seconds in zip(calls, times, strict=True):
            output, took = timed(target.device, decoder)
            outputs.append(output)
            seconds.append(took)
    return outputs, times


def _add(result: ModeResult, generation: Generation, seconds: float, another_sample: bool = False) -> None:
    result.new_tokens += len(generation.tokens)
    result.seconds += seconds
    if not another_sample:  # a prompt's further samples (run_bench's ``samples``) pool into the totals alone
        result.prompts += 1
        result.prompt_rates.append(len(generation.tokens) / seconds if seconds else 0.0)
        result.outputs.append(list(generation.tokens))
    result.rounds += generation.rounds
    result.accepted += sum(generation.accepted)
    depth = generation.max_depth
    if len(result.accepted_per_position) < depth:
        result.accepted_per_position += [0.0] * (depth - len(result.accepted_per_position))
    for i in range(depth):  # counts for now; divided by rounds at the end
        result.accepted_per_position[i] += sum(a > i for a in generation.accepted)
