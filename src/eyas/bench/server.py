"""``eyas bench --server URL [--server-plain URL]``: the bench's prompts against running OpenAI-compatible servers.

Prompts go as token ids to ``/v1/completions`` (streamed, so each request's first and last token are timed), from
C client threads at each concurrency level. τ comes from what the engine itself exposes, read before and after the
level (what each exposes was read in its source: docs/engine.md, "Measuring a deployment"):

- vLLM: ``/metrics`` counters ``vllm:spec_decode_num_drafts_total``, ``…num_accepted_tokens_total`` and
  ``…num_accepted_tokens_per_pos_total{position}``, summed over engines: τ = 1 + Δaccepted / Δdrafts.
- SGLang (≥ 0.5.23, with ``--enable-metrics``): ``sglang:spec_verify_calls_total`` with
  ``sglang:generation_tokens_total`` and ``sglang:num_requests_total`` (all moved when a request finishes):
  τ = (Δgenerated − Δrequests) / Δverify calls, the prefill's token taken out. Older SGLang exposes only a windowed
  gauge: no τ, and the report says so.

Standard library only: a server on another machine needs nothing installed but eyas.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from eyas.bench.serving import Level, Request
from eyas.data.benchmarks import Prompt
from eyas.errors import EyasError

TIMEOUT_S = 600  # one request's longest wait for the server


@dataclass
class Server:
    """A server as probed: its base URL, the engine behind it, the model ids it serves."""

    url: str
    kind: str  # "vllm", "sglang" or "unknown" (from /v1/models' owned_by)
    models: list[str]


def base_url(url: str) -> str:
    """``http://host:8000``, also when given with ``/v1`` or a trailing slash."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _get(url: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def _unreachable(url: str, err: Exception) -> EyasError:
    reason = getattr(err, "reason", err)
    return EyasError(f"cannot reach {url}: {reason}; is the server running, and is this its base URL (e.g. "
                     "http://localhost:8000)?")


def probe(url: str) -> Server:
    """The server at ``url``: GET /v1/models must answer as OpenAI-compatible servers do."""
    url = base_url(url)
    try:
        status, body = _get(f"{url}/v1/models")
    except (urllib.error.URLError, OSError) as err:
        raise _unreachable(url, err) from err
    try:
        data = json.loads(body)["data"] if status == 200 else None
        models = [m["id"] for m in data]
    except (ValueError, KeyError, TypeError):
        data = None
    if not data:
        raise EyasError(f"{url} does not answer as an OpenAI-compatible server: GET /v1/models gave HTTP {status}: "
                        f"{body.strip()[:200]!r}; pass the base URL of a vLLM or SGLang server")
    owner = str(data[0].get("owned_by", "")).lower()
    kind = "vllm" if "vllm" in owner else "sglang" if "sglang" in owner else "unknown"
    return Server(url=url, kind=kind, models=models)


def choose_model(servers: list[Server], model: str | None) -> str:
    """The model every server is asked for: ``model`` (which each must serve), else the first server's first."""
    chosen = model or servers[0].models[0]
    for server in servers:
        if chosen not in server.models:
            raise EyasError(f"{server.url} serves {', '.join(server.models)}, not {chosen!r}: "
                            + ("pass --server-model with one of them" if model else
                               "both servers must serve the same model (pass --server-model to name it)"))
    return chosen


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


def parse_metrics(text: str) -> dict[str, float | list[float]]:
    """Prometheus exposition text → each sample name summed over its label sets; a name with a ``position`` label
    becomes a list by position."""
    out: dict[str, float | list[float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        position = _POSITION.search(labels)
        if position:
            values = out.setdefault(name, [])
            index = int(position.group(1))
            values.extend([0.0] * (index + 1 - len(values)))
            values[index] += value
        else:
            out[name] = out.get(name, 0.0) + value
    return out


def scrape(server: Server) -> dict | None:
    """The server's /metrics, parsed; None when it serves none (SGLang without --enable-metrics)."""
    try:
        status, body = _get(f"{server.url}/metrics")
    except (urllib.error.URLError, OSError) as err:
        raise _unreachable(server.url, err) from err
    return parse_metrics(body) if status == 200 else None


def acceptance_counters(kind: str, before: dict | None, after: dict | None) -> tuple[dict | None, str]:
    """The level's (drafts, accepted, per_position) from two scrapes, and where they come from or why there are none."""
    if before is None or after is None:
        return None, "no /metrics on this server (SGLang: start it with --enable-metrics): no τ"

    def moved(name: str) -> float:
        return float(after.get(name, 0.0)) - float(before.get(name, 0.0))

    if kind == "vllm" or "vllm:spec_decode_num_drafts_total" in after:
        if "vllm:spec_decode_num_drafts_total" not in after:
            return None, "vLLM exposes no spec_decode counters: this server runs without speculation"
        per_after = after.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", [])
        per_before = before.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", []) + [0.0] * len(per_after)
        return ({"drafts": moved("vllm:spec_decode_num_drafts_total"),
                 "accepted": moved("vllm:spec_decode_num_accepted_tokens_total"),
                 "per_position": [a - b for a, b in zip(per_after, per_before, strict=False)]},
                "vLLM /metrics: 1 + Δspec_decode_num_accepted_tokens / Δspec_decode_num_drafts")
    if "sglang:spec_verify_calls_total" in after:
        verify = moved("sglang:spec_verify_calls_total")
        generated = moved("sglang:generation_tokens_total") - moved("sglang:num_requests_total")
        return ({"drafts": verify, "accepted": generated - verify, "per_position": []},
                "SGLang /metrics: (Δgeneration_tokens − Δnum_requests) / Δspec_verify_calls; no per-position counts")
    if any(name.startswith("sglang:spec_accept_length") for name in after):
        return None, ("this SGLang exposes only sglang:spec_accept_length, a gauge over its last decode batches, not "
                      "this run's: no τ (SGLang ≥ 0.5.23 counts verify calls)")
    return None, "the server exposes no speculative counters: no τ"


def _error_message(body: str) -> str:
    """The message of an error body: vLLM's {"error": {"message"}} or SGLang's flat {"message"}."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    error = data.get("error", data) if isinstance(data, dict) else data
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def complete(server: Server, model: str, prompt: Prompt, max_new_tokens: int, temperature: float, top_p: float,
             seed: int, stop_ids: list[int]) -> Request:
    """One streamed completion: its output ids (when the server returns them), token count and times."""
    payload = {"model": model, "prompt": prompt.input_ids, "max_tokens": max_new_tokens, "temperature": temperature,
               "top_p": top_p, "stream": True, "stream_options": {"include_usage": True}, "stop_token_ids": stop_ids}
    if temperature > 0:
        payload["seed"] = seed
    if server.kind == "vllm":
        payload["return_token_ids"] = True  # vLLM ≥ 0.10: each chunk's output ids
    request = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    tokens: list[int] | None = [] if server.kind == "vllm" else None
    chunks, usage = 0, None
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":
                    raise EyasError(f"{server.url} failed a request mid-answer: {_error_message(data)}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    if choice.get("text") or ids:
                        first = first or time.perf_counter()
                        chunks += 1
                    if tokens is not None:
                        tokens = tokens + list(ids) if ids is not None else None
    except urllib.error.HTTPError as err:
        message = _error_message(err.read().decode("utf-8", "replace"))
        raise EyasError(f"{server.url} refused the request (HTTP {err.code}): {message}") from err
    except (urllib.error.URLError, OSError) as err:
        raise _unreachable(server.url, err) from err
    end = time.perf_counter()
    count = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else (
        len(tokens) if tokens else chunks)
    return Request(dataset=prompt.dataset, output_tokens=count, latency_s=end - start,
                   first_token_s=(first or end) - start, tokens=tokens or None)


def run_level(server: Server, model: str, mode: str, prompts: list[Prompt], concurrency: int, max_new_tokens: int,
              temperature: float, top_p: float, seed: int, stop_ids: list[int]) -> Level:
    """Every prompt from ``concurrency`` client threads (a closed loop), the engine's counters read around it."""
    before = scrape(server)
    lock = threading.Lock()
    results: dict[int, Request] = {}

    def one(index: int) -> None:
        answer = complete(server, model, prompts[index], max_new_tokens, temperature, top_p, seed, stop_ids)
        with lock:
            results[index] = answer

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(one, i) for i in range(len(prompts))]:
            future.result()  # the first failure ends the level with its message
    seconds = time.perf_counter() - start
    counters, note = (None, "") if mode == "plain" else acceptance_counters(server.kind, before, scrape(server))
    return Level(engine="server", mode=mode, concurrency=concurrency, seconds=seconds,
                 requests=[results[i] for i in range(len(prompts))], counters=counters, tau_note=note,
                 where=f"{server.url} ({server.kind})")
