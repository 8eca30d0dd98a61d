"""``eyas bench --engine vllm``: the bench's prompts decoded by vLLM, without and with the drafter, at each
concurrency level.

vLLM runs under its own Python (the one ``eyas capture --engine vllm`` uses: --vllm-python or $EYAS_VLLM_PYTHON),
one worker process per configuration (``vllm_worker.py``: plain, then each chain mode with the drafter as vLLM's
``eagle3`` method). The worker's lines become :class:`~eyas.bench.serving.Level` records. vLLM drafts chains here:
a tree mode is measured in eyas' engine only, and the result's notes say so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas import families
from eyas.bench.serving import EngineResult, Level, Request
from eyas.capture.vllm_client import _Worker, check_vllm_python, resolve_vllm_python
from eyas.data.benchmarks import Prompt
from eyas.engine.acceptance import Sampling
from eyas.engine.modes import Speculation
from eyas.errors import EyasError
from eyas.export.files import read_draft_config
from eyas.target.loading import resolve_target

WORKER = Path(__file__).with_name("vllm_worker.py")
REFUSED = 3  # the worker's exit status when vLLM refused a configuration (vllm_worker.REFUSED)
# LLM(...) arguments the worker sets for the bench: --vllm-arg may not change them
BENCH_RESERVED = ("model", "speculative_config", "max_num_seqs", "disable_log_stats")


def vllm_configs(modes: list[Speculation], draft: Path | None,
                 samplings: list[Sampling] | None = None) -> tuple[list[dict], list[str]]:
    """The worker's configurations: plain, then one per chain its drafter family asks of vLLM
    (:meth:`eyas.families.Family.vllm_chains`: a block drafter's block, once) and sampling rule — eyas' rules are
    vLLM's ``draft_sample_method`` and ``rejection_sample_method``, named as eyas' rows (e.g. ``chain:5 drawn``); notes
    name the modes vLLM does not run here."""
    configs: list[dict] = [{"name": "plain"}]
    chains, notes = [], []
    if draft is not None:
        config = read_draft_config(Path(draft))
        chains, notes = families.of_config(config).vllm_chains(config, list(modes))
    for name, k, method in chains:
        for sampling in dict.fromkeys(s.resolved("chain") for s in samplings or [Sampling()]):
            config = {"name": " ".join(filter(None, (name, sampling.rule_label))), "draft": str(Path(draft).resolve()),
                      "k": k}
            if method is not None:  # else the worker's default method
                config["method"] = method
            if sampling.draft_sampling != "greedy" or sampling.verification != "standard":
                config.update(draft_sample_method=sampling.draft_sampling, rejection_sample_method=sampling.verification)
            configs.append(config)
    return configs, notes


def eyas_counterpart(engine_mode: str) -> str:
    """The eyas mode that decodes what an engine's configuration does, for comparing the two: a configuration named
    after a vLLM method, ``METHOD:K`` (a block drafter's K proposals of one forward, verified as a chain), is eyas'
    ``chain:K``, with the same rule; every other mode (plain, chain:K, tree:…) has the same name."""
    mode, _, rule = engine_mode.partition(" ")
    method, _, k = mode.partition(":")
    return " ".join(filter(None, (f"chain:{k}", rule))) if k and method not in ("chain", "tree") else engine_mode


def run_vllm(target: str, draft: Path | None, prompts: list[Prompt], modes: list[Speculation], concurrency: tuple[int, ...],
             max_new_tokens: int, temperature: float, top_p: float, seed: int, stop_ids: list[int], workdir: Path,
             vllm_python: str | None = None, engine_args: dict | None = None,
             samplings: list[Sampling] | None = None) -> EngineResult:
    """Run every configuration in vLLM (one worker process each) and return its levels, in order."""
    python = resolve_vllm_python(vllm_python)
    check_vllm_python(python)
    configs, notes = vllm_configs(modes, draft, samplings)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    request = {"model": resolve_target(target), "prompts": [p.input_ids for p in prompts],
               "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
               "stop_ids": list(stop_ids), "concurrency": list(concurrency), "configs": configs,
               "engine_args": engine_args or {}}
    (workdir / "request.json").write_text(json.dumps(request), encoding="utf-8")
    out = workdir / "levels.jsonl"
    out.unlink(missing_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU host; vLLM's default is larger
    result = EngineResult(notes=notes)
    for index, config in enumerate(configs):
        worker = _Worker([python, str(WORKER), str(workdir / "request.json"), str(out), str(index)])
        try:
            code = worker.process.wait()
            worker.returncode()
        finally:
            worker.stop()
        lines = read_levels(out)
        refused = [line for line in lines if line["config"] == config["name"] and "error" in line]
        if refused or code == REFUSED:
            what = f"the drafter {config.get('draft')}" if config.get("draft") else f"the target {request['model']}"
            message = refused[0]["error"] if refused else worker.log_tail()
            raise EyasError(f"vLLM refused {what} ({config['name']}): {message}")
        if code != 0:
            raise EyasError(f"the vLLM bench worker failed ({config['name']}, exit status {code}); the end of its log:\n"
                            f"{worker.log_tail()}")
    for line in read_levels(out):
        result.levels.append(level_from_worker(line, prompts))
        result.settings = line.get("engine_args", result.settings)
    return result


def read_levels(path: Path) -> list[dict]:
    """The worker's complete lines so far."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def level_from_worker(line: dict, prompts: list[Prompt]) -> Level:
    """One worker line as a :class:`Level`: requests in the prompts' order, with their datasets."""
    histograms = line.get("histograms") or [None] * len(prompts)
    requests = [Request(dataset=prompt.dataset, output_tokens=len(tokens), latency_s=latency, first_token_s=first,
                        tokens=list(tokens), histogram=histogram)
                for prompt, tokens, latency, first, histogram in zip(
                    prompts, line["outputs"], line["latency_s"], line["first_token_s"], histograms, strict=True)]
    counters = line.get("counters") if line["config"] != "plain" else None
    note = "" if line["config"] == "plain" else "vLLM's per-request speculative metrics and spec_decode counters"
    settings = line.get("engine_args", {})
    where = ", ".join(f"{k}={settings[k]}" for k in ("dtype", "enforce_eager", "max_num_seqs") if k in settings)
    return Level(engine="vllm", mode=line["config"], concurrency=line["concurrency"], seconds=line["seconds"],
                 requests=requests, counters=counters, tau_note=note, where=where)
