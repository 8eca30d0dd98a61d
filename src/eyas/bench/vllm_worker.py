"""Decode a bench's prompts in vLLM, without and with a drafter, at several concurrency levels.

A standalone script for the vLLM environment (it never imports eyas: that Python has vLLM's torch, and what it
measures must be vLLM's alone). eyas runs it as a subprocess (``eyas bench --engine vllm``):

    python vllm_worker.py REQUEST_JSON OUT_JSONL CONFIG_INDEX

REQUEST_JSON: ``{"model": HF dir, "prompts": [[ids...], ...], "max_new_tokens", "temperature", "top_p", "seed",
"stop_ids": [...], "concurrency": [1, 4, 16], "configs": [{"name": "plain"}, {"name": "chain:5", "draft": DIR,
"k": 5, "method": vLLM's speculative method, "eagle3" when not given}], "engine_args": {LLM(...) arguments asked for, null = the
worker's default}}``.

The config CONFIG_INDEX (one process per config, so each ``LLM`` starts clean): its ``LLM`` (the drafter as vLLM's
``eagle3`` speculative method), then for each concurrency level
C a closed loop over ``LLM.llm_engine``: at most C requests in flight, a new one added as one finishes (what a
server under C concurrent clients sees). Each request's own times are taken at the engine step that returns its
first and its last token. vLLM's speculative counters (``get_metrics()``: drafts, accepted tokens, accepted per
position) are read before and after each level, so τ = 1 + accepted / drafts is that level's own.

OUT_JSONL gets one line per level as it finishes: ``{"config", "concurrency", "outputs": [[ids]...],
"latency_s": [...], "first_token_s": [...], "histograms": [...], "seconds", "counters": {"drafts", "accepted",
"per_position"}}`` (``histograms``: each request's verify steps by drafts accepted, vLLM's per-request speculative
metrics; None without a drafter), and
one ``{"config", "error"}`` line when vLLM refuses the config (its own message); then the worker exits 3.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REFUSED = 3  # exit status: vLLM refused a config (the line in OUT_JSONL says why)


def log(message: str) -> None:
    print(f"vllm bench worker: {message}", flush=True)


def load_settings_rules():
    """eyas' vLLM settings rules (``capture/vllm_settings.py``, standard library only), by path: this script runs
    without eyas installed, and its folder is kept off sys.path (its siblings must not shadow vLLM's modules)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "capture" / "vllm_settings.py"
    spec = importlib.util.spec_from_file_location("eyas_vllm_settings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_counters(llm) -> dict:
    """vLLM's speculative counters now, summed over engines: drafts, accepted tokens, accepted per position."""
    out = {"drafts": 0, "accepted": 0, "per_position": []}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            out["per_position"] = [a + b for a, b in zip(values, out["per_position"] + [0] * len(values), strict=False)]
    return out


def difference(after: dict, before: dict) -> dict:
    """The counters one level moved."""
    before_pos = before["per_position"] + [0] * len(after["per_position"])
    return {"drafts": after["drafts"] - before["drafts"], "accepted": after["accepted"] - before["accepted"],
            "per_position": [a - b for a, b in zip(after["per_position"], before_pos, strict=False)]}


def closed_loop(engine, prompts: list[list[int]], params, concurrency: int, tag: str) -> dict:
    """Every prompt through ``engine`` with at most ``concurrency`` in flight: tokens and times per prompt."""
    pending = list(range(len(prompts)))
    live: dict[str, dict] = {}
    done: dict[int, dict] = {}
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            index = pending.pop(0)
            request_id = f"{tag}-{index}"
            engine.add_request(request_id, {"prompt_token_ids": prompts[index]}, params)
            live[request_id] = {"index": index, "start": time.perf_counter(), "first": None}
        for output in engine.step():
            now = time.perf_counter()
            request = live.get(output.request_id)
            if request is None:
                continue
            if request["first"] is None and len(output.outputs[0].token_ids):
                request["first"] = now
            if output.finished:
                spec = getattr(output.outputs[0], "spec_decode_metrics", None)  # with a drafter: this request's own
                done[request["index"]] = {"tokens": list(output.outputs[0].token_ids), "latency_s": now - request["start"],
                                          "first_token_s": (request["first"] or now) - request["start"],
                                          "histogram": None if spec is None else list(spec.histogram)}
                del live[output.request_id]
    seconds = time.perf_counter() - start
    order = [done[i] for i in range(len(prompts))]
    return {"outputs": [r["tokens"] for r in order], "latency_s": [r["latency_s"] for r in order],
            "first_token_s": [r["first_token_s"] for r in order], "histograms": [r["histogram"] for r in order],
            "seconds": seconds}


def engine_arguments(request: dict, config: dict, rules) -> tuple[dict, list[str]]:
    """The LLM(...) arguments of one config: eyas' settings rules over what was asked, then what the bench needs."""
    import torch

    on_cpu = not torch.cuda.is_available()
    facts = rules.target_facts(rules.read_config(request["model"]))
    asked = dict(request.get("engine_args") or {})
    eager = asked.pop("enforce_eager", None)
    settings, notes = rules.choose_settings(asked, on_cpu, on_cpu and rules.amx_available(), facts)
    # the rules default to eager (a capture prefills once); a bench decodes: CUDA graphs on a GPU, as served
    settings["enforce_eager"] = on_cpu if eager is None else eager
    longest = max(len(p) for p in request["prompts"]) + request["max_new_tokens"] + max(c.get("k", 0) for c in request["configs"])
    settings.setdefault("max_model_len", -(-(longest + 16) // 256) * 256)
    settings["max_num_seqs"] = max(request["concurrency"])
    settings["disable_log_stats"] = False  # get_metrics() needs the stats
    settings.setdefault("seed", request.get("seed", 0))
    model = Path(request["model"])
    if model.is_dir() and not any((model / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        settings["skip_tokenizer_init"] = True  # prompts and answers are token ids: a target without a tokenizer runs
    if config.get("draft"):
        settings["speculative_config"] = {"method": config.get("method", "eagle3"), "model": config["draft"],
                                          "num_speculative_tokens": config["k"]}
        for rule in ("draft_sample_method", "rejection_sample_method"):  # eyas' sampling rules, as vLLM names them
            if rule in config:
                settings["speculative_config"][rule] = config[rule]
        # each request's verify steps by accepted drafts (vLLM 0.32+): τ per dataset from one pooled loop
        settings.setdefault("per_request_spec_decode_metrics", "summary")
    return settings, notes


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    out, config = Path(argv[1]), request["configs"][int(argv[2])]
    rules = load_settings_rules()
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=request["temperature"], top_p=request.get("top_p", 1.0),
                            max_tokens=request["max_new_tokens"], stop_token_ids=request.get("stop_ids") or None,
                            seed=request.get("seed", 0) if request["temperature"] > 0 else None)
    settings, notes = engine_arguments(request, config, rules)
    for note in notes:
        log(f"default {note}")
    log(f"{config['name']}: LLM({', '.join(f'{k}={v!r}' for k, v in settings.items())})")
    try:
        llm = LLM(model=request["model"], **settings)
    except Exception as refused:  # vLLM's own message is what the user needs: it goes back whole
        write_line(out, {"config": config["name"], "error": f"{type(refused).__name__}: {refused}"})
        return REFUSED
    engine = llm.llm_engine
    warm = SamplingParams(temperature=0, max_tokens=4)  # allocator, kernels, lazy initialisation: not timed
    closed_loop(engine, request["prompts"][:1], warm, 1, "warm")
    for concurrency in request["concurrency"]:
        before = spec_counters(llm)
        measured = closed_loop(engine, request["prompts"], params, concurrency, f"c{concurrency}")
        counters = difference(spec_counters(llm), before)
        write_line(out, {"config": config["name"], "concurrency": concurrency, **measured, "counters": counters,
                         "engine_args": {k: v for k, v in settings.items() if k != "speculative_config"}})
        tokens = sum(len(o) for o in measured["outputs"])
        log(f"{config['name']} at concurrency {concurrency}: {tokens} tokens in {measured['seconds']:.1f} s")
    return 0


def write_line(out: Path, record: dict) -> None:
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
