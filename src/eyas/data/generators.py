"""Turn generators: the target answering a batch of chat prompts, in-process or through a server.

Both return one ``Answer`` or one ``Exception`` per prompt, in order: a prompt that fails fails
only its own conversation, never the run. Errors that mean the whole setup is broken (no chat
template, server unreachable at start) are raised as ``EyasError`` when the generator is built.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from eyas.data.render import ChatTemplateError, chat_ids, chat_template_for
from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.data.options import RegenerationOptions

Messages = list[dict[str, str]]
log = logging.getLogger(__name__)

# How long the start-up probe of a server may take: a wrong address should fail fast.
_PROBE_TIMEOUT = 30.0
_MAX_BACKOFF = 60.0


@dataclass
class Answer:
    """The target's answer to one prompt; ``truncated`` when it stopped at max_new_tokens."""

    text: str
    truncated: bool = False


class TurnGenerator(Protocol):
    """Anything that answers a batch of chat prompts, one result per prompt, in order."""

    def generate(self, prompts: list[Messages]) -> list[Answer | Exception]: ...


class GenerationError(EyasError):
    """One prompt could not be answered (the server refused it, or retries ran out)."""


# --------------------------------------------------------------------------- in-process (HF)


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` means the GPU ran out of memory: torch's OutOfMemoryError, or cuDNN's attention failing to run
    its graph (seen on an H200 when the allocator could not give it a workspace: a plain RuntimeError)."""
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "mha_graph.execute" in str(err)


class HFGenerator:
    """Answers with a transformers model: chat template, left-padded batches, greedy or sampled, decoded by eyas'
    batched loop (:mod:`eyas.data.batched_decode`) or by transformers' ``generate`` (``options.generator``)."""

    def __init__(self, model: Any, tokenizer: Any, options: RegenerationOptions, chat_template: str | None = None):
        if tokenizer is None:
            raise EyasError("regeneration needs the target's tokenizer, and this target ships none; "
                            "point the target at a directory with tokenizer files, or use --server")
        self.template = chat_template_for(tokenizer, chat_template)
        self.model, self.tokenizer, self.options = model, tokenizer, options
        from eyas.target.loading import stop_ids

        self.eos_ids = stop_ids(model, tokenizer)
        # Padding is masked out, so any id works; fall back to EOS, then 0, when there is no pad token.
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self._calls = 0
        self._static_caches: dict[tuple[int, int], Any] = {}  # (batch, cache length) → a reusable StaticCache
        self._decoder: Any = None  # the eyas generator's BatchedDecoder, built on first use

    @property
    def loop(self) -> str:
        """The decoding loop in use: options.generator, else eyas' on CUDA and transformers' generate elsewhere."""
        if self.options.generator is not None:
            return self.options.generator
        return "eyas" if self.model.get_input_embeddings().weight.device.type == "cuda" else "hf-generate"

    def generate(self, prompts: list[Messages]) -> list[Answer | Exception]:
        """Answer every prompt, ``batch_size`` at a time, longest first (least padding)."""
        results: list[Answer | Exception | None] = [None] * len(prompts)
        encoded: dict[int, list[int]] = {}
        for i, messages in enumerate(prompts):
            try:
                encoded[i] = chat_ids(self.tokenizer, messages, self.template)
            except ChatTemplateError:
                raise  # the template itself is broken: every prompt would fail
            except Exception as err:  # a template may reject one conversation (raise_exception): fail only that one
                results[i] = GenerationError(f"chat template failed: {err}")
        order = sorted(encoded, key=lambda i: -len(encoded[i]))
        size = max(1, self.options.batch_size)
        for start in range(0, len(order), size):
            batch = order[start:start + size]
            started = time.perf_counter()
            for i, result in zip(batch, self._generate_batch([encoded[i] for i in batch]), strict=True):
                results[i] = result
            log.info("generated %d answers (prompts up to %d tokens) in %.1f s", len(batch),
                     max(len(encoded[i]) for i in batch), time.perf_counter() - started)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _generate_batch(self, rows: list[list[int]]) -> list[Answer | Exception]:
        """One ``model.generate`` call; on CUDA out-of-memory, split the batch in halves."""
        import torch  # here, not at the top: the server path should start without loading torch

        try:
            return self._run_eyas(rows) if self.loop == "eyas" else self._run_generate(rows)
        except RuntimeError as err:
            if not _out_of_memory(err):
                raise
            if self._decoder is not None:
                self._decoder.release()  # its caches are sized for the batch that did not fit
            torch.cuda.empty_cache()
            if len(rows) == 1:
                return [GenerationError(f"out of GPU memory on a {len(rows[0])}-token prompt: {err}")]
            half = len(rows) // 2
            return self._generate_batch(rows[:half]) + self._generate_batch(rows[half:])

    def _run_generate(self, rows: list[list[int]]) -> list[Answer | Exception]:
        import torch

        from eyas.target.compat import cache_keyword

        device = self.model.get_input_embeddings().weight.device
        static = self.options.static_cache if self.options.static_cache is not None else device.type == "cuda"
        count = len(rows)
        width = max(len(r) for r in rows)
        if static:
            # Few distinct shapes, each compiled once: widths rounded up to a power of two (≥ 256) and
            # every batch filled to batch_size (with copies of its last prompt, whose answers are dropped).
            width = max(256, 1 << (width - 1).bit_length())
            rows = rows + [rows[-1]] * (max(self.options.batch_size, count) - count)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for n, row in enumerate(rows):  # left padding: every prompt ends where generation starts
            input_ids[n, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[n, width - len(row):] = 1
        sampling = self.options.sampling_temperature > 0
        kwargs: dict[str, Any] = dict(max_new_tokens=self.options.max_new_tokens, do_sample=sampling,
                                      pad_token_id=self.pad_id, eos_token_id=self.eos_ids or None)
        if sampling:
            kwargs["temperature"] = self.options.sampling_temperature
            # Reproducible for a given seed and call sequence; greedy runs leave the global RNG alone.
            torch.manual_seed(self.options.seed + self._calls)
            self._calls += 1
        with torch.inference_mode():  # the cache's tensors are inference tensors: reset them in here too
            if static:
                kwargs[cache_keyword(self.model)] = self._static_cache(len(rows), width + self.options.max_new_tokens)
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), **kwargs)
        return [self._answer(row.tolist()) for row in out[:count, width:].cpu()]

    def _run_eyas(self, rows: list[list[int]]) -> list[Answer | Exception]:
        """The batch through :class:`eyas.data.batched_decode.BatchedDecoder`; each row samples from its own seed."""
        from eyas.data.batched_decode import BatchedDecoder, row_seed

        if self._decoder is None:
            self._decoder = BatchedDecoder(self.model, self.eos_ids, self.pad_id, max_batch=self.options.batch_size)
        seeds = [row_seed(self.options.seed, row) for row in rows]
        tokens = self._decoder.decode(rows, self.options.max_new_tokens, self.options.sampling_temperature, seeds)
        return [self._answer(row) for row in tokens]

    def _static_cache(self, batch: int, length: int):
        """One StaticCache per shape, emptied before each use: a new cache object would be compiled anew."""
        from transformers import StaticCache

        key = (batch, length)
        if key not in self._static_caches:
            self._static_caches[key] = StaticCache(config=self.model.config, max_cache_len=length)
        cache = self._static_caches[key]
        cache.reset()
        return cache

    def _answer(self, new_tokens: list[int]) -> Answer:
        """Cut at the first stop token; no stop token means max_new_tokens ran out."""
        stops = set(self.eos_ids)
        cut = next((k for k, t in enumerate(new_tokens) if t in stops), None)
        kept = new_tokens if cut is None else new_tokens[:cut]
        return Answer(self.tokenizer.decode(kept, skip_special_tokens=True), truncated=cut is None)


# --------------------------------------------------------------------------- OpenAI-compatible server


class _Retryable(Exception):
    """A failure worth retrying (connection, timeout, 429, 5xx); ``wait`` is the server's Retry-After."""

    def __init__(self, message: str, wait: float | None = None):
        super().__init__(message)
        self.wait = wait


class OpenAIServerGenerator:
    """Answers through ``POST {server}/chat/completions``, ``concurrency`` requests in flight."""

    def __init__(self, options: RegenerationOptions, backoff: float = 1.0):
        if not options.server:
            raise EyasError("OpenAIServerGenerator needs options.server, e.g. http://127.0.0.1:8000/v1")
        self.options = options
        self.base = options.server.rstrip("/")
        self.backoff = backoff  # first retry waits this long, then doubles
        self.served = self._served_models()
        if options.model:
            self.model = options.model
        elif self.served:
            self.model = self.served[0]
        else:
            raise EyasError(f"the server at {self.base} lists no models at {self.base}/models; pass the model name "
                            "explicitly (--model)")

    def generate(self, prompts: list[Messages]) -> list[Answer | Exception]:
        """Send every prompt, up to ``concurrency`` at once; results come back in prompt order."""
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.options.concurrency, len(prompts)))) as pool:
            return list(pool.map(self._answer_or_error, prompts))

    def _answer_or_error(self, messages: Messages) -> Answer | Exception:
        try:
            return self._answer(messages)
        except GenerationError as err:
            return err

    def _answer(self, messages: Messages) -> Answer:
        """One chat completion, retried with exponential backoff on transient failures."""
        body = json.dumps({
            "model": self.model,
            "messages": messages,
            "temperature": self.options.sampling_temperature,
            "max_tokens": self.options.max_new_tokens,
            "seed": self.options.seed,
        }).encode("utf-8")
        attempts = max(0, self.options.retries) + 1
        for attempt, delay in zip(range(attempts), _delays(self.backoff), strict=False):
            try:
                return _parse_reply(self._post(body))
            except _Retryable as err:
                if attempt + 1 == attempts:
                    raise GenerationError(f"gave up after {attempts} attempt(s): {err}") from err
                time.sleep(min(err.wait if err.wait is not None else delay, _MAX_BACKOFF))
        raise AssertionError("unreachable")  # the loop returns or raises

    def _post(self, body: bytes) -> dict:
        """POST the request; sort failures into retryable ones and final ones."""
        request = urllib.request.Request(f"{self.base}/chat/completions", data=body, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            message = f"HTTP {err.code}: {_server_message(err)}"
            if err.code == 429 or err.code >= 500:
                raise _Retryable(message, _retry_after(err)) from err
            raise GenerationError(message) from err  # the request itself is wrong: retrying cannot help
        except TimeoutError as err:
            raise _Retryable(f"no reply within {self.options.timeout:g}s") from err
        except urllib.error.URLError as err:
            raise _Retryable(f"connection failed: {err.reason}") from err
        except (OSError, http.client.HTTPException) as err:  # reset, remote disconnected, incomplete read
            raise _Retryable(f"connection failed: {err!r}") from err
        try:
            return json.loads(raw)
        except ValueError as err:
            raise _Retryable(f"reply is not JSON: {raw[:200]!r}") from err

    def _served_models(self) -> list[str]:
        """GET {server}/models: proves the server is there, and names its models."""
        url = f"{self.base}/models"
        request = urllib.request.Request(url, headers=self._headers())
        check = ("Check that the server is running and that --server is its OpenAI base URL, "
                 "usually ending in /v1 (e.g. http://127.0.0.1:8000/v1)")
        try:
            with urllib.request.urlopen(request, timeout=min(self.options.timeout, _PROBE_TIMEOUT)) as reply:
                listing = json.loads(reply.read())
        except urllib.error.HTTPError as err:
            raise EyasError(f"the server at {url} answered HTTP {err.code}: {_server_message(err)}. {check}") from err
        except (OSError, http.client.HTTPException, ValueError) as err:
            reason = getattr(err, "reason", None) or err
            raise EyasError(f"cannot reach an OpenAI-compatible server at {url} ({reason}). {check}") from err
        data = listing.get("data") if isinstance(listing, dict) else None
        return [m["id"] for m in data or [] if isinstance(m, dict) and "id" in m]

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        # Servers started with an API key (vLLM --api-key, SGLang --api-key) read it from the usual variable.
        if key := os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {key}"
        return headers


def _delays(first: float) -> Iterator[float]:
    """first, 2·first, 4·first, … seconds."""
    delay = first
    while True:
        yield delay
        delay *= 2


def _parse_reply(reply: Any) -> Answer:
    """The first choice's message content; finish_reason "length" means truncated."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise GenerationError(f"reply has no choices: {str(reply)[:200]}")
    choice = choices[0]
    content = (choice.get("message") or {}).get("content") or ""
    return Answer(text=content, truncated=choice.get("finish_reason") == "length")


def _server_message(err: urllib.error.HTTPError) -> str:
    """The server's own explanation: the JSON error message when there is one, else the body's start."""
    try:
        raw = err.read()
    except OSError:
        return str(err.reason)
    try:
        body = json.loads(raw)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:500]
    except ValueError:
        pass
    return raw[:500].decode("utf-8", "replace").strip() or str(err.reason)


def _retry_after(err: urllib.error.HTTPError) -> float | None:
    """Retry-After in seconds, when the server sent a number."""
    try:
        return float(err.headers.get("Retry-After", ""))
    except (TypeError, ValueError):
        return None
