"""OpenAI-compatible servers that answer as vLLM 0.32 and SGLang 0.5.x do, for `eyas bench --server` in CI.

Response shapes are the engines' own, read in their source (vLLM 0.32: entrypoints/openai/completion/protocol.py and
serving.py, v1/spec_decode/metrics.py, v1/metrics/loggers.py; SGLang 0.5.23, 0.5.6 and 0.5.2:
entrypoints/openai/protocol.py, observability/metrics_collector.py): /v1/models, streamed /v1/completions (SSE chunks,
the usage chunk with `choices: []`, `data: [DONE]`), error bodies (vLLM's {"error": {...}} with 404 for an unknown
model; SGLang's flat one), and /metrics in Prometheus text with the engines' names, labels and `_created` lines.

Answers are real greedy decodes of an HF target (transformers), so eyas' engine must agree with them token for
token. Speculation is simulated: verify steps accept a fixed cycle of drafts, each step one chunk, counted in the
engine's counters the way the engine counts them.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACCEPT_CYCLE = (2, 0, 3, 1)
K = 3


class FakeServer:
    """``kind``: vllm, sglang (0.5.23: verify-call counters), sglang-old (0.5.6: only gauges), sglang-nometrics, html
    (not an OpenAI API at all). ``speculative``: whether it drafts. ``step_s``: the time one engine step takes; it must dominate the
    fake's own greedy decode (which the GIL serialises across client threads, the same for plain and speculative), or
    a speedup measured against the fake is noise (at 4 ms it measured 0.77–0.85× at 4 in flight, run to run; at 20 ms
    once 0.42× in a loaded CI run): each answer is decoded once and remembered, so a level repeating the prompts of an
    earlier one times engine steps only."""

    def __init__(self, kind: str, target: str, speculative: bool = True, model: str = "served-target",
                 step_s: float = 0.02):
        import torch
        from transformers import AutoModelForCausalLM

        self.kind, self.speculative, self.model_name, self.step_s = kind, speculative, model, step_s
        self.model = AutoModelForCausalLM.from_pretrained(target).float().eval()
        self.torch = torch
        self.lock = threading.Lock()
        self.answers: dict[tuple, list[int]] = {}  # greedy answers already decoded, by (prompt, max_tokens, stops)
        self.counts = {"drafts": 0, "accepted": 0, "per_position": [0] * K, "generated": 0, "requests": 0}
        self.in_flight = 0
        self.max_in_flight = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def tau(self) -> float:
        return 1 + self.counts["accepted"] / self.counts["drafts"]

    def greedy(self, prompt: list[int], max_tokens: int, stops: set[int]) -> list[int]:
        """The target's greedy answer, decoded once per request and remembered: a later level asking the same prompt
        again costs no decode, so its time is its engine steps' alone (what a speedup between levels compares)."""
        key = (tuple(prompt), max_tokens, frozenset(stops))
        if key not in self.answers:
            self.answers[key] = self._decode(prompt, max_tokens, stops)
        return self.answers[key]

    def _decode(self, prompt: list[int], max_tokens: int, stops: set[int]) -> list[int]:
        ids = self.torch.tensor([prompt])
        out: list[int] = []
        with self.torch.no_grad():
            for _ in range(max_tokens):
                token = int(self.model(ids).logits[0, -1].argmax())
                out.append(token)
                if token in stops:
                    break
                ids = self.torch.cat([ids, self.torch.tensor([[token]])], dim=1)
        return out

    # -- what the engines answer ---------------------------------------------------------------------------------
    def models_body(self) -> dict:
        owner = "vllm" if self.kind == "vllm" else "sglang"
        card = {"id": self.model_name, "object": "model", "created": 1796324325, "owned_by": owner,
                "root": self.model_name, "parent": None, "max_model_len": 2048}
        return {"object": "list", "data": [card]}

    def metrics_text(self) -> str | None:
        c = self.counts
        if self.kind == "vllm":
            labels = f'engine="0",model_name="{self.model_name}"'
            lines = ["# HELP vllm:generation_tokens_total Number of generation tokens processed.",
                     "# TYPE vllm:generation_tokens_total counter",
                     f"vllm:generation_tokens_total{{{labels}}} {float(c['generated'])}"]
            if self.speculative:  # vLLM creates the spec_decode counters only with a speculative_config
                for name, value in (("num_drafts", c["drafts"]), ("num_draft_tokens", c["drafts"] * K),
                                    ("num_accepted_tokens", c["accepted"])):
                    lines += [f"# HELP vllm:spec_decode_{name}_total Number of spec decoding {name}.",
                              f"# TYPE vllm:spec_decode_{name}_total counter",
                              f"vllm:spec_decode_{name}_total{{{labels}}} {float(value)}",
                              f"# TYPE vllm:spec_decode_{name}_created gauge",
                              f"vllm:spec_decode_{name}_created{{{labels}}} 1.7963242635538237e+09"]
                lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(v)}'
                          for i, v in enumerate(c["per_position"])]
            return "\n".join(lines) + "\n"
        if self.kind == "sglang-nometrics" or self.kind == "html":
            return None
        gauge = (f'{{engine_type="unified",model_name="{self.model_name}",moe_ep_rank="0",pp_rank="0",tp_rank="0"}}')
        lines = ["# TYPE sglang:spec_accept_length gauge", f"sglang:spec_accept_length{gauge} 2.85"]
        if self.kind == "sglang":  # 0.5.23: counters moved when a request finishes
            streaming = f'{{engine_type="unified",is_streaming="true",model_name="{self.model_name}"}}'
            plain = f'{{engine_type="unified",model_name="{self.model_name}"}}'
            lines += ["# TYPE sglang:generation_tokens_total counter",
                      f"sglang:generation_tokens_total{streaming} {float(c['generated'])}",
                      "# TYPE sglang:spec_verify_calls_total counter",
                      f"sglang:spec_verify_calls_total{plain} {float(c['drafts'])}",
                      "# TYPE sglang:num_requests_total counter",
                      f"sglang:num_requests_total{streaming} {float(c['requests'])}"]
        return "\n".join(lines) + "\n"

    def error(self, status: int, message: str) -> tuple[int, dict]:
        if self.kind == "vllm":
            kind = "NotFoundError" if status == 404 else "BadRequestError"
            return status, {"error": {"message": message, "type": kind, "param": "model", "code": status}}
        return status, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}

    def steps(self, answer: list[int]) -> list[list[int]]:
        """The answer cut into engine steps: the prefill's token, then verify steps of accepted + 1 tokens."""
        out, emitted, step = [answer[:1]], 1, 0
        while emitted < len(answer):
            if not self.speculative:
                out.append(answer[emitted: emitted + 1])
                emitted += 1
                continue
            accepted = min(ACCEPT_CYCLE[step % len(ACCEPT_CYCLE)], K, len(answer) - emitted - 1)
            step += 1
            with self.lock:
                self.counts["drafts"] += 1
                self.counts["accepted"] += accepted
                for i in range(accepted):
                    self.counts["per_position"][i] += 1
            out.append(answer[emitted: emitted + accepted + 1])
            emitted += accepted + 1
        return out

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def send(self, status: int, body, content_type: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if server.kind == "html":
                    self.send(404, "<html><body>Not Found</body></html>", "text/html")
                elif self.path == "/v1/models":
                    self.send(200, server.models_body())
                elif self.path == "/metrics":
                    text = server.metrics_text()
                    if text is None:
                        self.send(404, {"detail": "Not Found"})
                    else:
                        self.send(200, text, "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self.send(404, {"detail": "Not Found"})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self.send(404, {"detail": "Not Found"})
                if server.kind == "vllm" and request.get("model") not in (None, "", server.model_name):
                    return self.send(*server.error(404, f"The model `{request['model']}` does not exist. Valid "
                                                        f"aliases: {server.model_name}."))
                if not isinstance(request.get("prompt"), list) or not request["prompt"]:
                    return self.send(*server.error(400, "Prompt cannot be empty"))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    answer = server.greedy(request["prompt"], request["max_tokens"], set(request.get("stop_token_ids") or []))
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    ids = server.kind == "vllm" and request.get("return_token_ids")
                    for chunk in server.steps(answer):
                        time.sleep(server.step_s)
                        choice = {"index": 0, "text": "".join(f" t{t}" for t in chunk), "logprobs": None,
                                  "finish_reason": None, "stop_reason": None}
                        if ids:
                            choice.update(prompt_token_ids=None, token_ids=chunk)
                        body = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000,
                                "model": server.model_name, "choices": [choice]}
                        self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                        self.wfile.flush()
                    with server.lock:
                        server.counts["generated"] += len(answer)
                        server.counts["requests"] += 1
                    if (request.get("stream_options") or {}).get("include_usage"):
                        usage = {"prompt_tokens": len(request["prompt"]), "total_tokens": len(request["prompt"]) + len(answer),
                                 "completion_tokens": len(answer)}
                        body = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000,
                                "model": server.model_name, "choices": [], "usage": usage}
                        self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                finally:
                    with server.lock:
                        server.in_flight -= 1

        return Handler
