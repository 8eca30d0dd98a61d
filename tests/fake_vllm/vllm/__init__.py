"""A stand-in for vLLM 0.32's offline API, for eyas' vLLM bench worker in CI (no vLLM there).

Put this folder's parent on PYTHONPATH. What the worker touches has vLLM 0.32's shapes (read in its source):
``LLM(model, **engine_args)`` and its ``llm_engine`` (``add_request(request_id: str, prompt, params)``, ``step()``,
``has_unfinished_requests()``), ``RequestOutput`` (``request_id``, ``outputs[0].token_ids`` cumulative,
``outputs[0].spec_decode_metrics`` on the finished output with a ``histogram``, ``finished``), ``get_metrics()``
(``Counter`` and ``Vector`` records, names without ``_total``; it asserts stats are on, as vLLM's does), and a drafter
directory without weights refused with vLLM's default loader's message.

The answers are real: the target (an HF directory) decodes greedily with transformers, so eyas' engine and this
"engine" must agree token for token. Speculation is simulated: each verify step accepts a fixed cycle of draft
counts (capped by k and by what is left of the answer), counted the way vLLM's scheduler counts them.
Every LLM(...) call's arguments are appended to $FAKE_VLLM_RECORD (JSON lines), for the tests to read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ACCEPT_CYCLE = (2, 0, 3, 1)  # drafts accepted at successive verify steps (before the cap by k)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    seed: int | None = None


@dataclass
class Counter:
    name: str
    labels: dict
    value: int


@dataclass
class Vector:
    name: str
    labels: dict
    values: list[int]


@dataclass
class RequestSpecDecodeMetrics:
    num_spec_tokens: int
    histogram: list[int] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


def _greedy(model, prompt: list[int], max_tokens: int, stops: set[int]) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            if token in stops:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


class _Engine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.live: dict[str, dict] = {}

    def add_request(self, request_id, prompt, params, **_):
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        stops = set(params.stop_token_ids or []) | set(self.llm.eos)
        answer = _greedy(self.llm.model, prompt["prompt_token_ids"], params.max_tokens, stops)
        k = self.llm.k
        self.live[request_id] = {"answer": answer, "emitted": 0, "step": 0,
                                 "histogram": [0] * (k + 1) if k else None}
        if len(self.live) > self.llm.max_num_seqs:
            raise RuntimeError("more requests in flight than max_num_seqs")
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, r in list(self.live.items()):
            left = len(r["answer"]) - r["emitted"]
            if r["emitted"] == 0 or not self.llm.k:  # the prefill's token, or plain decoding: one token
                r["emitted"] += 1
            else:  # a verify step: accepted drafts + the bonus token
                accepted = min(ACCEPT_CYCLE[r["step"] % len(ACCEPT_CYCLE)], self.llm.k, left - 1)
                r["step"] += 1
                r["histogram"][accepted] += 1
                self.llm.counts["drafts"] += 1
                self.llm.counts["accepted"] += accepted
                for i in range(accepted):
                    self.llm.counts["per_position"][i] += 1
                r["emitted"] += accepted + 1
            finished = r["emitted"] >= len(r["answer"])
            metrics = (RequestSpecDecodeMetrics(self.llm.k, list(r["histogram"]))
                       if finished and r["histogram"] is not None else None)
            outputs.append(RequestOutput(request_id, [CompletionOutput(0, r["answer"][: r["emitted"]],
                                                                       "stop" if finished else None, metrics)], finished))
            if finished:
                del self.live[request_id]
        return outputs


class LLM:
    def __init__(self, model: str, speculative_config: dict | None = None, disable_log_stats: bool = True,
                 max_num_seqs: int = 256, **engine_args):
        from transformers import AutoModelForCausalLM, GenerationConfig

        record = os.environ.get("FAKE_VLLM_RECORD")
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"model": model, "speculative_config": speculative_config,
                                    "disable_log_stats": disable_log_stats, "max_num_seqs": max_num_seqs,
                                    **engine_args}) + "\n")
        if speculative_config is not None:
            draft = Path(speculative_config["model"])
            if not any(draft.glob("*.safetensors")):
                raise RuntimeError(f"Cannot find any model weights with `{draft}`")  # vLLM's default loader
        self.k = speculative_config["num_speculative_tokens"] if speculative_config else 0
        self.log_stats = not disable_log_stats
        self.max_num_seqs = max_num_seqs
        self.model = AutoModelForCausalLM.from_pretrained(model).float().eval()
        eos = GenerationConfig.from_pretrained(model).eos_token_id if Path(model, "generation_config.json").exists() else None
        self.eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.counts = {"drafts": 0, "accepted": 0, "per_position": [0] * self.k}
        self.llm_engine = _Engine(self)

    def get_metrics(self) -> list:
        assert self.log_stats, "Stat logging disabled"
        labels = {"model_name": "m", "engine": "0"}
        if not self.k:  # no speculative_config: vLLM creates no spec_decode counters
            return [Counter("vllm:generation_tokens", labels, 0)]
        return [Counter("vllm:spec_decode_num_drafts", labels, self.counts["drafts"]),
                Counter("vllm:spec_decode_num_draft_tokens", labels, self.counts["drafts"] * self.k),
                Counter("vllm:spec_decode_num_accepted_tokens", labels, self.counts["accepted"]),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, list(self.counts["per_position"]))]
