"""What a serving engine measured: the bench's prompts at one concurrency level, without or with speculation.

One model for both ways eyas measures an engine: vLLM run offline under its own Python (``eyas bench --engine
vllm``) and running OpenAI-compatible servers (``eyas bench --server URL``). Every level is a closed loop: at most C
requests in flight, a new one sent as one finishes. τ is 1 + accepted drafts / verify steps, as vLLM counts it and
eyas' engine reports it; an engine that exposes no such count gets no τ, and the report says why instead of guessing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Request:
    """One prompt's answer: its dataset, output ids (None when the engine returns none), times, acceptance."""

    dataset: str
    output_tokens: int
    latency_s: float  # request sent → last token
    first_token_s: float  # request sent → first token
    tokens: list[int] | None = None
    histogram: list[int] | None = None  # verify steps by drafts accepted (index j: steps that accepted j)

    @property
    def time_per_output_token_s(self) -> float | None:
        """Decode time per token after the first (None for a one-token answer)."""
        return (self.latency_s - self.first_token_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class Level:
    """Every prompt through one engine configuration at one concurrency level."""

    engine: str  # "vllm" (offline, eyas-driven) or "server"
    mode: str  # "plain", "chain:K" (vLLM offline), "speculative" (a server: its own configuration)
    concurrency: int
    seconds: float  # the loop's wall time, first request sent → last answer
    requests: list[Request]
    counters: dict | None = None  # the engine's own counters over the level: drafts, accepted, per_position
    tau_note: str = ""  # where τ comes from, or why there is none
    where: str = ""  # the server's URL, or vLLM's LLM(...) settings in words

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def time_per_output_token_ms(self) -> float | None:
        """The mean over requests of their decode time per token, in ms (what serving benchmarks call TPOT)."""
        each = [t for r in self.requests if (t := r.time_per_output_token_s) is not None]
        return 1000 * sum(each) / len(each) if each else None

    def datasets(self) -> list[str]:
        return list(dict.fromkeys(r.dataset for r in self.requests))

    def acceptance(self, dataset: str | None = None) -> tuple[float, list[float]] | None:
        """(τ, share of verify steps accepted to each draft depth) over ``dataset``'s requests (all: None).

        From the requests' own histograms when every one has its histogram; for all requests, else from the level's
        counters; None when neither exists (a plain run, or an engine that exposes no acceptance)."""
        chosen = [r for r in self.requests if dataset is None or r.dataset == dataset]
        if chosen and all(r.histogram is not None for r in chosen):
            depth = max(len(r.histogram) for r in chosen)
            pooled = [sum(r.histogram[j] for r in chosen if j < len(r.histogram)) for j in range(depth)]
            steps = sum(pooled)
            if not steps:
                return None
            accepted = sum(j * count for j, count in enumerate(pooled))
            reached = [sum(pooled[j] for j in range(i + 1, depth)) / steps for i in range(depth - 1)]
            return 1 + accepted / steps, reached
        if dataset is None and self.counters and self.counters.get("drafts"):
            drafts = self.counters["drafts"]
            return (1 + self.counters["accepted"] / drafts,
                    [a / drafts for a in self.counters.get("per_position", [])])
        return None

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tokens": self.output_tokens, "tokens_per_second": self.tokens_per_second,
                "time_per_output_token_ms": self.time_per_output_token_ms}

    @classmethod
    def from_dict(cls, data: dict) -> Level:
        fields_ = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields_["requests"] = [Request(**r) for r in data["requests"]]
        return cls(**fields_)


@dataclass
class EngineResult:
    """Every level one engine measured, and what its run said about itself (settings, notes)."""

    levels: list[Level] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def engine_rows(levels: list[Level]) -> list[dict]:
    """One row per (engine, mode, concurrency): throughput, TPOT, τ, and the speedup over the same engine's plain run
    at the same concurrency (None without one)."""
    plain = {(lv.engine, lv.concurrency): lv for lv in levels if lv.mode == "plain"}
    rows = []
    for level in levels:
        base = plain.get((level.engine, level.concurrency))
        measured = level.acceptance()
        rows.append({
            "engine": level.engine, "mode": level.mode, "concurrency": level.concurrency,
            "in_flight": min(level.concurrency, len(level.requests)), "prompts": len(level.requests),
            "tokens_per_second": level.tokens_per_second, "time_per_output_token_ms": level.time_per_output_token_ms,
            "tau": None if measured is None else measured[0],
            "accepted_per_position": None if measured is None else measured[1],
            "tau_by_dataset": {d: a[0] for d in level.datasets() if (a := level.acceptance(d)) is not None},
            "speedup": (level.tokens_per_second / base.tokens_per_second
                        if base is not None and level is not base and base.tokens_per_second else None),
            "tau_note": level.tau_note,
        })
    return rows
