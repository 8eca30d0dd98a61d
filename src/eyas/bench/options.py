"""The options of ``eyas bench``: each field's default and help, once (the decoding ones are shared with generate)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from eyas.data.benchmarks import DATASETS, MAX_PROMPT_TOKENS
from eyas.options import (
    HTTP_URL,
    Check,
    EngineOptions,
    at_least,
    draft_sampling_option,
    each,
    force_option,
    one_of,
    option,
    temperature_option,
    verification_option,
    vllm_args_option,
    vllm_python_option,
)
from eyas.speculation import MODE_SPELLING, Sampling, parse_modes

ENGINES = ("eyas", "vllm")


@dataclass
class BenchOptions(EngineOptions):
    """Measure a drafter: τ, acceptance per position, tokens/s speculative vs plain — in eyas' engine, in vLLM, and
    against running servers.

    Every prompt is decoded without speculation and in every --mode, in one run on one machine; the report gives
    each dataset's τ (1 + accepted / rounds, as vLLM counts it) and speedup. --engine vllm runs the same prompts in
    vLLM (chain modes; the drafter as its eagle3 method) at each --concurrency; --server URL measures a running
    vLLM or SGLang server (and --server-plain URL the same target without speculation). With eyas and an engine
    in one run the report compares them: τ ratio and, greedy in fp32, token-for-token equality.
    """

    target: str = option(help="the target the drafter serves")
    out: Path = option(help="REPORT_DIR: report.json, report.md, acceptance.png")
    draft: Path | None = option(None, "DRAFT_DIR: eyas', SpecForge's, EAGLE's or speculators' layout (needed by the "
                                "engines; a --server runs its own)")
    datasets: tuple[str, ...] = option(("mt-bench", "humaneval", "sharegpt-holdout"),
                                       "comma-separated: mt-bench, humaneval, sharegpt-holdout (needs --data), "
                                       "sharegpt-long (needs --data: each held-out conversation's whole history before "
                                       "its last answer, reported by length bucket :1k, :2k, :4k, :8k …, as long as "
                                       "the target's window allows)", flag="--dataset",
                                       check=each(one_of(*DATASETS)))
    data: Path | None = option(None, "DATA_DIR: its holdout for sharegpt-holdout; its training prompts are kept out of "
                               "every benchmark")
    modes: str = option("chain:5,tree:60,7,10", "chain:K and/or tree:TOTAL,DEPTH,TOPK, comma-separated within, ';' or "
                        "repeated ':' groups between: e.g. chain:5,tree:60,7,10 (not given: the drafter family's own "
                        "default where it has one, a block drafter's whole block as one chain)",
                        flag="--mode",
                        check=Check(parse_modes, "one or more of " + MODE_SPELLING, shown=False))
    prompts: int | None = option(None, "the first N prompts of each dataset (all if not given)", check=at_least(1))
    max_prompt_tokens: int = option(MAX_PROMPT_TOKENS, "longer prompts are skipped and counted (not sharegpt-long's: "
                                    "they are as long as the target's window leaves room for)", check=at_least(1))
    repeats: int = option(1, "decode each prompt this many times per decoder, taking turns; each prompt's median time "
                          "counts (steadier speedups on a busy machine)", check=at_least(1))
    samples: int = option(1, "at T > 0, decode each prompt this many times per decoder, at seeds --seed … --seed + N − 1, "
                          "and pool them: one sampled answer a prompt makes τ a draw of its own (the released drafter's "
                          "drawn chain:3 on 10 MT-bench prompts × 256 tokens: τ 1.633 at seed 0, 1.570 pooled over seeds "
                          "0 and 1)", check=at_least(1))
    engines: tuple[str, ...] | None = option(None, "comma-separated: eyas (eyas' engine, one request at a time), vllm "
                                             "(vLLM under --vllm-python, at each --concurrency); eyas,vllm runs both "
                                             "side by side (default: eyas, or none with --server)", flag="--engine",
                                             check=each(one_of(*ENGINES)))
    concurrency: tuple[int, ...] = option((1, 4, 16), "requests in flight at once, comma-separated levels (--engine "
                                          "vllm and --server; eyas' engine decodes one at a time)",
                                          check=each(at_least(1)))
    server: str | None = option(None, "base URL of a running OpenAI-compatible server (vLLM, SGLang) serving the target "
                                "with its drafter, e.g. http://localhost:8000", check=HTTP_URL)
    server_plain: str | None = option(None, "base URL of the same target served without speculation: --server's "
                                      "baseline for the speedup")
    server_model: str | None = option(None, "the model name the servers are asked for (default: the first one "
                                      "GET /v1/models lists)")
    vllm_python: str | None = vllm_python_option()
    vllm_args: list[str] = vllm_args_option("--engine vllm")
    _: KW_ONLY  # the three below override EngineOptions' (keyword-only there) with lists: keyword-only here too
    temperature: tuple[float, ...] = temperature_option((0.0, 1.0), "one or more, comma-separated, every mode running at "
                                                        "each beside that temperature's plain run (default: T = 0 and "
                                                        "T = 1 side by side; --engine vllm and --server measure the first)")
    draft_sampling: tuple[str, ...] = draft_sampling_option(("auto",), "comma-separated, each a decoder of its own beside "
                                                            "the others (e.g. greedy,probabilistic measures both rules in "
                                                            "one run; probabilistic's rows read 'drawn')")
    verification: tuple[str, ...] = verification_option(("standard",), "comma-separated as --draft-sampling (block's "
                                                         "rows read 'block')")
    force: bool = force_option()

    def samplings(self) -> list:
        """Each sampling rule to decode with (:class:`eyas.speculation.Sampling`), temperature by temperature:
        every --draft-sampling with every --verification; greedy decoding (T = 0) has one rule."""
        return [Sampling(temperature, self.top_p, self.seed) if temperature <= 0 else
                Sampling(temperature, self.top_p, self.seed, drafts, verification)
                for temperature in dict.fromkeys(self.temperature)
                for drafts in (self.draft_sampling if temperature > 0 else ("auto",))
                for verification in (self.verification if temperature > 0 else ("standard",))]

    def sampling(self):
        """The first of :meth:`samplings`: the engines' and servers' temperature (they measure one)."""
        return self.samplings()[0]

    def chosen_engines(self) -> tuple[str, ...]:
        """The engines this run decodes in: --engine, else eyas' own unless a --server is measured instead."""
        if self.engines is not None:
            return self.engines
        return () if self.server else ("eyas",)
