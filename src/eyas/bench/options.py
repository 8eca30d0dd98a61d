"""The options of ``eyas bench``: each field's default and help, once (the decoding ones are shared with generate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.data.benchmarks import DATASETS
from eyas.engine.modes import MODE_SPELLING, parse_modes
from eyas.options import Check, EngineOptions, at_least, each, force_option, one_of, option


@dataclass
class BenchOptions(EngineOptions):
    """Measure a drafter in eyas' engine: τ, acceptance per position, tokens/s speculative vs plain.

    Every prompt is decoded without speculation and in every --mode, in one run on one machine; the
    report gives each dataset's τ (1 + accepted / rounds, as vLLM counts it) and speedup.
    """

    target: str = option(help="the target the drafter serves")
    draft: Path = option(help="DRAFT_DIR: eyas', SpecForge's, EAGLE's or speculators' layout")
    out: Path = option(help="REPORT_DIR: report.json, report.md, acceptance.png")
    datasets: tuple[str, ...] = option(("mt-bench", "humaneval", "sharegpt-holdout"),
                                       "comma-separated: mt-bench, humaneval, sharegpt-holdout (needs --data)", flag="--dataset",
                                       check=each(one_of(*DATASETS)))
    data: Path | None = option(None, "DATA_DIR: its holdout for sharegpt-holdout; its training prompts are kept out of "
                               "every benchmark")
    modes: str = option("chain:5,tree:60,7,10", "chain:K and/or tree:TOTAL,DEPTH,TOPK, comma-separated within, ';' or "
                        "repeated ':' groups between: e.g. chain:5,tree:60,7,10", flag="--mode",
                        check=Check(parse_modes, "one or more of " + MODE_SPELLING, shown=False))
    prompts: int | None = option(None, "the first N prompts of each dataset (all if not given)", check=at_least(1))
    max_prompt_tokens: int = option(1024, "longer prompts are skipped and counted", check=at_least(1))
    repeats: int = option(1, "decode each prompt this many times per decoder, taking turns; each prompt's median time "
                          "counts (steadier speedups on a busy machine)", check=at_least(1))
    force: bool = force_option()
