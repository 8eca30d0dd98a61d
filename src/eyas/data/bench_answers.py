"""The target's own answers to benchmark prompts, decoded as ``eyas bench`` decodes its plain runs: the paths training
predicts τ on (:mod:`eyas.train.prediction`).

At T = 0 a speculative chain emits the plain answer token for token (what bench checks), so a drafter's τ on a prompt
is a function of that one answer: decoded here by the engine's plain decoding on the runner bench would use (its
variant on the device: CUDA graphs, compiled, lean, in the target's dtype; its cache for these prompts, modes and
--max-new-tokens), it is the answer bench's chains will emit. In bf16 on a GPU another decoder's answer may fork from
it at a near-tie and take a different τ from there, and so does one over another cache size: attention spans the
whole static cache, and its kernels round differently over different lengths. On an H100 (2026-12-07) the released
drafter's HumanEval answers, all ending before 256 tokens, measured τ 1.973 in bench's 512-token run and 2.008 in its
256-token run (benchmarks/results/2026-12-07_h100_predict-vs-bench). So each answer length is decoded on its own
runner, as bench's run of that length would. Sampled (T > 0), any answer drawn from the target serves: speculation
emits the target's distribution, so several answers per prompt (seeds 0 … n−1) estimate what bench's draws average.

Each answer runs past its stop token and past its limit by a chain's depth + 1 tokens: the last round of a generation
judges drafts beyond what it emits (its acceptance counts in τ), and they are judged against these tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from eyas.data.benchmarks import Prompt
from eyas.data.samples import Sample


@dataclass
class AnsweredPrompt:
    """One benchmark prompt answered by the target as bench's run of ``limit`` tokens decodes it: ``answer`` runs past
    the limit and past any stop token; bench emits its first :attr:`emitted` tokens."""

    dataset: str
    prompt_id: str
    temperature: float
    seed: int
    prompt: list[int]
    answer: list[int]
    stop_at: int | None  # the answer's tokens up to and including its first stop token (None: it has none)
    limit: int  # the --max-new-tokens of the bench run it was decoded as

    @property
    def emitted(self) -> int:
        """The tokens bench emits with ``--max-new-tokens limit``: up to the first stop token (kept), at most ``limit``."""
        return min(self.limit, self.stop_at) if self.stop_at is not None else self.limit

    @property
    def key(self) -> str:
        """A sample id unique within a prediction set (the order samples are sorted in)."""
        return f"{self.dataset}/{self.prompt_id}/T{self.temperature:g}/{self.seed}/{self.limit}"

    def sample(self) -> Sample:
        """As a training sample: the prompt, then the answer, the answer's tokens loss-masked."""
        ids = np.asarray(self.prompt + self.answer, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[len(self.prompt):] = 1
        return Sample(self.key, ids, mask)


def answer_as_bench(target, prompts: Sequence[Prompt], layer_ids: Sequence[int], modes: str, limit: int,
                    temperatures: Sequence[float], samples: int, progress=None,
                    compile: bool | None = None) -> tuple[list[AnsweredPrompt], str]:
    """``prompts`` answered by a loaded ``target`` (:class:`eyas.target.loading.Target`) as ``eyas bench --mode MODES
    --max-new-tokens LIMIT`` decodes its plain runs — bench's variant on the target's device (its --graphs, --lean and
    --compile defaults, :class:`eyas.options.EngineOptions`; ``compile`` False: bench's --no-compile), its cache for
    these prompts and modes (static-shape attention spans the whole cache: its size is part of the arithmetic), the
    drafter's taps (``layer_ids``) recorded — each answer ``limit`` + the deepest mode's depth + 1 tokens long
    (:func:`answer_prompts`) → (the answers, the engine variant that decoded them)."""
    from eyas.engine.room import checked_capacity
    from eyas.engine.target_runner import TargetRunner
    from eyas.speculation import parse_modes
    from eyas.target.loading import stop_ids

    chosen = parse_modes(modes)
    longest = max(len(prompt.input_ids) for prompt in prompts)
    capacity = checked_capacity(target, longest, limit, chosen, len(prompts))
    runner = TargetRunner(target.model, target.layout, layer_ids, capacity, **bench_decoder(compile))
    try:
        answered = answer_prompts(runner, prompts, temperatures, samples, limit, max(m.max_depth for m in chosen) + 1,
                                  set(stop_ids(target.model, target.tokenizer)), bench_default("top_p"), progress)
    finally:
        runner.close()
    return answered, runner.variant


def bench_default(name: str):
    """The default of ``eyas bench``'s engine flag ``name`` (:class:`eyas.options.EngineOptions`): what bench decodes
    with when not told otherwise."""
    from dataclasses import fields

    from eyas.options import EngineOptions

    return next(f.default for f in fields(EngineOptions) if f.name == name)


def bench_decoder(compile: bool | None = None) -> dict:
    """The runner bench decodes on, as :class:`eyas.engine.target_runner.TargetRunner`'s keywords: its --graphs, --lean
    and --compile defaults (``compile`` given: bench's --compile / --no-compile)."""
    return {"graphs": bench_default("graphs"), "lean": bench_default("lean"),
            "compile": bench_default("compile") if compile is None else compile}


def answer_prompts(runner, prompts: Sequence[Prompt], temperatures: Sequence[float], samples: int, limit: int,
                   beyond: int, stop_ids: set[int], top_p: float, progress=None) -> list[AnsweredPrompt]:
    """Each prompt answered by the engine's plain decoding on ``runner`` (an :class:`eyas.engine.target_runner.TargetRunner`)
    at every temperature — once at T = 0, ``samples`` times (seeds 0 … samples−1) above — ``limit`` + ``beyond`` tokens
    long, through stop tokens (each answer's first one recorded)."""
    from eyas.engine.acceptance import Sampling
    from eyas.engine.decode import generate

    answered = []
    for prompt in prompts:
        ids = torch.tensor([prompt.input_ids], dtype=torch.long)
        for temperature in temperatures:
            for seed in range(1 if temperature <= 0 else samples):
                sampling = Sampling(temperature, top_p, seed) if temperature > 0 else Sampling()
                answer = generate(runner, ids, limit + beyond, sampling=sampling).tokens
                stop = next((i + 1 for i, token in enumerate(answer) if token in stop_ids), None)
                answered.append(AnsweredPrompt(prompt.dataset, prompt.id, float(temperature), seed,
                                               list(prompt.input_ids), answer, stop, limit))
        if progress is not None:
            progress(1)
    return answered


def answers_key(target, identity: dict, prompts: Sequence[Prompt], layer_ids: Sequence[int], modes: str, limit: int,
                temperatures: Sequence[float], samples: int, compile: bool | None = None) -> str | None:
    """A digest of everything :func:`answer_as_bench`'s answers depend on — the target's weights (``identity``: their
    fingerprints; None when unknown, and then nothing is cached) and the ids that stop its turns, the prompts, the taps,
    the modes and limit (the cache's size), the temperatures and samples, the decoder (bench's variant as
    :func:`answer_as_bench` resolves it, the device's kind, the dtype, torch's and transformers' versions, and the code
    that decodes and samples: eyas' engine, :mod:`eyas.sampling`, this module) — or None."""
    import hashlib
    import json
    from pathlib import Path

    import transformers

    from eyas.target.fingerprint import FINGERPRINTS
    from eyas.target.loading import stop_ids

    if not all(identity.get(key) for key in FINGERPRINTS):
        return None
    package = Path(__file__).resolve().parents[1]
    code = sorted([*(package / "engine").glob("*.py"), package / "sampling.py", Path(__file__).resolve()])
    weight = target.layout.embed.weight
    parts = {"target": [identity[key] for key in FINGERPRINTS], "stops": stop_ids(target.model, target.tokenizer),
             "prompts": hashlib.sha256(json.dumps([[p.dataset, p.id, p.input_ids] for p in prompts]).encode()).hexdigest(),
             "layer_ids": list(layer_ids), "modes": modes, "limit": limit, "temperatures": list(temperatures),
             "samples": samples, "decoder": bench_decoder(compile),
             "device": torch.cuda.get_device_name(weight.device) if weight.device.type == "cuda" else "cpu",
             "dtype": str(weight.dtype), "torch": torch.__version__, "transformers": transformers.__version__,
             "code": hashlib.sha256(b"".join(f.read_bytes() for f in code)).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _answers_path(key: str):
    from eyas.io import cache_dir

    return cache_dir() / "bench-answers" / f"{key}.json"


@contextmanager
def answering_alone(key: str | None):
    """Held while a run looks for the answers kept under ``key`` and, finding none, decodes and keeps them: another
    process answering the same prompts (runs of a table started side by side) waits here for them instead of decoding
    them too — an exclusive ``flock`` on ``KEY.lock`` beside the cache file, released by the kernel if the holder dies.
    Nothing without a key."""
    if not key:
        yield
        return
    import fcntl

    lock = _answers_path(key).with_suffix(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run answering the same prompts (lock {lock})", flush=True)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def cached_answers(key: str | None) -> tuple[list[AnsweredPrompt], str] | None:
    """The (answers, variant) an earlier run kept under ``key`` (:func:`answers_key`), or None: no key, none kept, or
    a file that cannot be read (then decoded again, and written over)."""
    import json

    path = _answers_path(key) if key else None
    if path is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        return [AnsweredPrompt(**a) for a in saved["answered"]], saved["decoder"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_answers(key: str | None, answered: list[AnsweredPrompt], decoder: str) -> None:
    """Keep (answers, variant) in the eyas cache under ``key`` for :func:`cached_answers` (nothing without a key)."""
    from dataclasses import asdict

    from eyas.io import write_json_atomic

    if key:
        path = _answers_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"decoder": decoder, "answered": [asdict(a) for a in answered]})
