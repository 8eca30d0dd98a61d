"""The options of ``eyas prepare`` (and of regeneration inside it): each field's default and help, once."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from eyas.options import (HTTP_URL, SEED, Options, above, at_least, chat_template_file, each, force_option, one_of, option,
                          remote_code, within)

GENERATORS = ("eyas", "hf-generate")


@dataclass
class RegenerationOptions(Options):
    """How to generate: sampling, limits, and where the target runs (a server, or in-process)."""

    temperature: tuple[float, ...] = option((0.0,), "regeneration sampling temperature, one or more, comma-separated: "
                                            "every conversation is answered once at each and DATA_DIR keeps every "
                                            "answer (0 = greedy; 0,0.8 = greedy and sampled answers, what a drafter "
                                            "served at T > 0 learns most from: docs/recipe.md)",
                                            check=each(at_least(0)))
    max_new_tokens: int = option(1024, "longest regenerated answer", check=at_least(1))
    server: str | None = option(None, "OpenAI-compatible server for --regenerate (e.g. http://127.0.0.1:8000/v1)",
                                check=HTTP_URL)
    model: str | None = option(None, "model name on the server (default: its first model)", flag="--server-model")
    concurrency: int = option(16, "parallel requests to the server", check=at_least(1))
    batch_size: int = option(8, "prompts per batch when regenerating in-process", check=at_least(1))
    generator: str | None = option(None, "in-process decoding loop: eyas (batched, fixed-shape steps replayed from CUDA "
                                   "graphs, nothing compiled) or hf-generate (transformers' generate) (default: eyas on "
                                   "CUDA, hf-generate elsewhere)", check=one_of(*GENERATORS))
    # a GPU decode step is launch-bound without a static cache
    static_cache: bool | None = option(None, "with --generator hf-generate: generate over a reused static KV cache that "
                                       "transformers compiles (default: on CUDA; each prompt-width bucket compiles once)",
                                       flag="--static-cache/--no-static-cache")
    retries: int = option(3, "retries per request (exponential backoff)", check=at_least(0))
    timeout: float = option(300.0, "seconds per request", check=above(0))
    seed: int = option(0, "regeneration sampling seed (with --temperature > 0)", check=SEED)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, int | float):  # one temperature, as a Python caller may give it
            self.temperature = (self.temperature,)
        self.temperature = tuple(float(t) for t in self.temperature)  # a list from JSON (the workers' options file)
        super().__post_init__()

    def answer_sets(self) -> list[RegenerationOptions]:
        """The options of each set of answers, one per temperature in order: every conversation is answered once by
        each."""
        return [replace(self, temperature=(t,)) for t in self.temperature]

    @property
    def sampling_temperature(self) -> float:
        """The temperature one set of answers is generated at (a generator's options: :meth:`answer_sets`)."""
        if len(self.temperature) != 1:
            raise ValueError(f"one set of answers has one temperature, not {self.temperature}: use answer_sets()")
        return self.temperature[0]


@dataclass
class PrepareOptions(Options):
    """Turn conversations into DATA_DIR: token ids, assistant-only loss masks, train/holdout split, draft vocab.

    Malformed records are skipped and counted (file and line); statistics are printed and saved in
    DATA_DIR/manifest.json. With --regenerate the answers come from the target itself (in-process, or
    through --server, or one worker per GPU); a killed run resumes from the journals DATA_DIR/regenerated*.jsonl.
    """

    target: str = option(help="the target whose tokenizer and chat template render the data")
    data: list[str] = option(help="a .json/.jsonl/.parquet file, a folder of them, 'sharegpt' (built in) or a hub dataset; "
                             "repeatable")
    out: Path = option(help="DATA_DIR to write")
    max_length: int = option(2048, "longest sample in tokens", check=at_least(2))
    overflow: str = option("truncate", "what to do with longer samples: truncate or drop", flag="--on-overflow",
                           check=one_of("truncate", "drop"))
    holdout: float = option(0.05, "fraction held out for evaluation (chosen by a hash of the conversation id)",
                            check=within(0, 1, high_open=True))
    draft_vocab_size: int = option(32000, "draft vocabulary size Vd (identity when ≥ the target's vocabulary)",
                                   check=at_least(1))
    chat_template: Path | None = chat_template_file()
    limit: int | None = option(None, "use only the first N usable conversations", check=at_least(1))
    regenerate: bool = option(False, "replace every assistant turn by the target's own answer")
    regeneration: RegenerationOptions = option(factory=RegenerationOptions)
    # not part of the fingerprint: the answers do not depend on how the conversations were spread over GPUs
    workers: int | None = option(None, "in-process regeneration: one worker (a copy of the target) per GPU, each answering "
                                 "every N-th conversation (default: every visible GPU)", check=at_least(1))
    force: bool = force_option()
    trust_remote_code: bool = remote_code()
