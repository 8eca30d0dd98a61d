"""The τ ``eyas bench`` will measure, predicted while training (``eyas train --predict``).

bench decodes a prompt's answer in rounds: the prefill emits the first token, then each round drafts K tokens after
what was emitted, keeps the first m the rule accepts and emits m + 1; τ = 1 + accepted / rounds, pooled over a
dataset's prompts. Along a known answer that process is a function of one thing per round: the chance that draft k is
kept, the drafts before it kept, when the round starts after n emitted tokens. Training computes those chances with the
drafter's own forward (training-time test along the answer: the drafts before k kept means they were the answer's
tokens), and this module runs the rounds over them:

- at T = 0 a chance is 0 or 1 (the drafter's argmax is the answer's next token or not) and the rounds are bench's
  rounds exactly, as long as the answer is the one bench's decoder emits (:mod:`eyas.data.bench_answers`);
- sampled, a drawn draft that ends up emitted as token x was kept with probability min(p(x), q(x)) / p(x) (p the target's
  and q the drafter's sampling distribution: the token rule keeps a draft x with min(1, p/q) and emits p's
  distribution), independently round by round given the answer; the expected rounds and accepted drafts follow by
  dynamic programming from the answer's end (:func:`expected_rounds`), averaged over several answers drawn from the target.

The answers are the target's to bench's own prompts (the first ``--predict-prompts`` of each dataset, as bench picks
them), so the prediction is of the run ``eyas bench --prompts N --max-new-tokens L --mode chain:K`` makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eyas.data.bench_answers import AnsweredPrompt


@dataclass
class PredictionSet:
    """What training predicts on: the answered prompts, a source of their target states (batches of
    :class:`eyas.train.data.OnlineSource`, rows in ``source.samples`` order), and what to predict."""

    answered: list[AnsweredPrompt]
    source: object
    depths: tuple[int, ...]  # the chains predicted: chain:K for each K
    limits: tuple[int, ...]  # bench's --max-new-tokens values
    top_p: float
    decoder: str  # the engine variant that answered (bench's, on this device)

    def by_key(self) -> dict[str, AnsweredPrompt]:
        return {answered.key: answered for answered in self.answered}


def build_prediction(options, target, data_dir: Path | None, layer_ids: Sequence[int], device, dtype,
                     identity: dict | None = None) -> PredictionSet:
    """The target (loaded, online) answers bench's prompts of the ``options.predict`` datasets as bench would decode
    them (:func:`eyas.data.bench_answers.answer_as_bench`) — or a run before this one did, on the same weights
    (``identity``: their fingerprints) and decoder, and the eyas cache kept them — and a source captures their states."""
    from eyas.data.bench_answers import (answer_as_bench, answering_alone, answers_key, bench_default, cached_answers,
                                         keep_answers)
    from eyas.data.benchmarks import MAX_PROMPT_TOKENS, load_prompts
    from eyas.errors import EyasError
    from eyas.progress import progress_bar
    from eyas.speculation import chain_depths
    from eyas.train.data import OnlineSource

    prompts, _ = load_prompts(list(options.predict), target.tokenizer, data_dir, options.predict_prompts,
                              MAX_PROMPT_TOKENS)
    if not prompts:
        raise EyasError(f"--predict {','.join(options.predict)}: no prompt of {MAX_PROMPT_TOKENS} tokens or fewer to "
                        "answer")
    temperatures = tuple(dict.fromkeys((0.0, *options.predict_temperatures)))
    limits = tuple(sorted(set(options.predict_tokens)))
    answered = []
    with progress_bar("answering bench's prompts", len(prompts) * len(limits), unit="prompt") as bar:
        for limit in limits:  # each on its own cache, as bench's run of that length (eyas.data.bench_answers)
            key = answers_key(target, identity or {}, prompts, layer_ids, options.predict_modes, limit, temperatures,
                              options.predict_samples)
            with answering_alone(key):  # runs started side by side decode them once
                kept = cached_answers(key)
                if kept is None:
                    kept = answer_as_bench(target, prompts, layer_ids, options.predict_modes, limit, temperatures,
                                           options.predict_samples, progress=bar)
                    keep_answers(key, *kept)
                else:
                    bar(len(prompts))
            more, decoder = kept
            answered += more
    source = OnlineSource(target, None, None, layer_ids, options.token_budget, device, dtype,
                          compile_layers=options.compile_layers, samples=[a.sample() for a in answered])
    return PredictionSet(answered, source, chain_depths(options.predict_modes), limits, bench_default("top_p"), decoder)


def expected_rounds(chances: np.ndarray, emitted: int) -> tuple[float, float]:
    """(expected rounds, expected accepted drafts) of chains of K = ``chances.shape[1]`` drafts decoding an answer until
    ``emitted`` tokens are out; ``chances[n, k]``: the chance draft k of a round that starts after n emitted tokens is
    kept, drafts 0 … k−1 kept (rows 1 … emitted − 1 are read). The last round's acceptance counts whole, as bench counts
    it, though it may emit past the end."""
    depth = chances.shape[1]
    rounds = np.zeros(emitted + 1)  # from n emitted tokens on; 0 once all are out (a round never reaches past that)
    accepted = np.zeros(emitted + 1)
    reach = np.arange(depth + 1)  # drafts a round may keep
    for n in range(emitted - 1, 0, -1):
        kept = np.concatenate([[1.0], np.cumprod(chances[n])])  # every draft up to k kept
        stops = kept * np.concatenate([1.0 - chances[n], [1.0]])  # exactly m kept
        after = np.minimum(n + reach + 1, emitted)  # rounds and acceptance from there on are 0 once it is out
        rounds[n] = 1.0 + stops @ rounds[after]
        accepted[n] = stops @ (reach + accepted[after])
    return float(rounds[1]), float(accepted[1])


def predicted_tau(prediction: PredictionSet, chances: dict[str, np.ndarray]) -> list[dict]:
    """One row per dataset, chain, temperature and answer length: the τ bench will measure there (1 + expected
    accepted / expected rounds over the dataset's answers), from each answer's ``chances`` (:func:`expected_rounds`'s,
    ``max(depths)`` wide; a chain of K reads the first K columns)."""
    rows = []
    groups: dict[tuple[str, float], list[AnsweredPrompt]] = {}
    for answered in prediction.answered:
        groups.setdefault((answered.dataset, answered.temperature), []).append(answered)
    for (dataset, temperature), answers in groups.items():
        for depth in prediction.depths:
            for limit in prediction.limits:
                mine = [a for a in answers if a.limit == limit]
                totals = np.array([expected_rounds(chances[a.key][:, :depth], a.emitted) for a in mine])
                rounds, accepted = totals.sum(0)
                rows.append({"dataset": dataset, "mode": f"chain:{depth}", "temperature": temperature,
                             "max_new_tokens": limit, "tau": 1.0 + accepted / rounds if rounds else 1.0,
                             "prompts": len({a.prompt_id for a in mine}), "answers": len(mine)})
    return rows


def prediction_table(rows: list[dict], decoder: str | None = None) -> str:
    """The predicted τ as a Markdown table: a row per dataset, chain and temperature, a column per answer length."""
    limits = sorted({row["max_new_tokens"] for row in rows})
    cells: dict[tuple, dict[int, float]] = {}
    for row in rows:
        cells.setdefault((row["dataset"], row["mode"], row["temperature"], row["prompts"]), {})[row["max_new_tokens"]] = \
            row["tau"]
    head = "| dataset | mode | T | prompts | " + " | ".join(f"τ at {n} tokens" for n in limits) + " |\n"
    lines = [head, "| --- " * (4 + len(limits)) + "|\n"]
    for (dataset, mode, temperature, prompts), taus in cells.items():
        rule = " drawn" if temperature > 0 else ""
        lines.append(f"| {dataset} | {mode}{rule} | {temperature:g} | {prompts} | "
                     + " | ".join(f"{taus[n]:.2f}" if n in taus else "—" for n in limits) + " |\n")
    said = f" (answers decoded by eyas' engine, {decoder})" if decoder else ""
    return "".join(lines) + f"\nPredicted by `eyas train --predict`{said}: the τ `eyas bench --prompts N --max-new-tokens L " \
        "--mode chain:K` measures on these prompts.\n"
