"""Regeneration: turn-by-turn answers from the target, in-process and via a server, resumable after a kill."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eyas.data.conversation import Conversation, Turn
from eyas.data.regenerate import (
    Answer,
    HFGenerator,
    JournalError,
    OpenAIServerGenerator,
    RegenerationOptions,
    make_generator,
    regenerate,
)
from eyas.errors import EyasError


def conv(cid: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(id=cid, turns=[Turn(role, content) for role, content in turns], origin=f"test:{cid}")


def mixed_conversations() -> list[Conversation]:
    """Multi-turn with a system prompt, single-turn, prompt-only, and one ending in a user turn."""
    return [
        conv("multi", ("system", "Be brief."), ("user", "What is a drafter?"), ("assistant", "old 1"),
             ("user", "And EAGLE-3?"), ("assistant", "old 2")),
        conv("single", ("user", "Name a prime."), ("assistant", "old")),
        conv("prompt-only", ("user", "Say something.")),
        conv("open-end", ("user", "Hi."), ("assistant", "old"), ("user", "Bye?")),
    ]


def check_regenerated(source: Conversation, result: Conversation) -> None:
    """System/user turns kept verbatim; every assistant turn is new and flagged; a final user turn is answered."""
    expected_len = len(source.turns) + (source.turns[-1].role == "user")
    assert result.id == source.id and result.origin == source.origin and len(result.turns) == expected_len
    for i, turn in enumerate(result.turns):
        if i < len(source.turns) and source.turns[i].role != "assistant":
            assert turn == source.turns[i]
        else:
            assert turn.role == "assistant" and turn.regenerated and turn.content.strip()
            assert turn.content != "old" and not turn.content.startswith("old ")


class Recorder:
    """Wraps a generator and keeps every prompt it was sent."""

    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    def generate(self, prompts):
        self.prompts.extend(prompts)
        return self.inner.generate(prompts)


class Scripted:
    """A pure-Python generator: answers from the prompt, or fails prompts whose last message says so."""

    def generate(self, prompts):
        out = []
        for messages in prompts:
            last = messages[-1]["content"]
            if "FAIL" in last:
                out.append(RuntimeError("scripted failure"))
            elif "EMPTY" in last:
                out.append(Answer("  "))
            else:
                out.append(Answer(f"re: {last} (after {len(messages)} messages)"))
        return out


# --------------------------------------------------------------------------- orchestration and journal


def test_scripted_generator_regenerates_every_kind_of_conversation(tmp_path):
    source = mixed_conversations()
    recorder = Recorder(Scripted())
    result, stats = regenerate(source, tmp_path / "j.jsonl", recorder, RegenerationOptions(batch_size=2), progress=False)
    assert [c.id for c in result] == [c.id for c in source]
    for s, r in zip(source, result, strict=True):
        check_regenerated(s, r)
    assert (stats.conversations_done, stats.conversations_failed, stats.turns_generated) == (4, 0, 6)
    # The second answer of "multi" was asked with the first *regenerated* answer in its prompt.
    second = next(p for p in recorder.prompts if p[-1]["content"] == "And EAGLE-3?")
    assert second[2] == {"role": "assistant", "content": result[0].turns[2].content}
    journaled = [Conversation.from_json(json.loads(line)) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert sorted(journaled, key=lambda c: c.id) == sorted(result, key=lambda c: c.id)


def test_failed_and_empty_answers_fail_their_conversation_only_and_are_not_journaled(tmp_path, caplog):
    source = [conv("ok", ("user", "fine")), conv("bad", ("user", "a"), ("assistant", "x"), ("user", "FAIL now")),
              conv("empty", ("user", "EMPTY please"))]
    journal = tmp_path / "j.jsonl"
    with caplog.at_level("WARNING", logger="eyas.data.regenerate"):
        result, stats = regenerate(source, journal, Scripted(), RegenerationOptions(), progress=False)
    # each failure is said when it happens (a run killed before its report still tells why)
    assert sorted(r.getMessage() for r in caplog.records) == [
        "conversation bad failed (not journaled; a rerun retries it): turn 3: scripted failure",
        "conversation empty failed (not journaled; a rerun retries it): turn 1: empty answer"]
    assert [c.id for c in result] == ["ok"]
    assert stats.conversations_failed == 2 and len(stats.failures) == 2
    assert sorted(stats.failures) == ["bad: turn 3: scripted failure", "empty: turn 1: empty answer"]
    assert [json.loads(line)["id"] for line in journal.read_text().splitlines()] == ["ok"]


def test_journal_resumes_drops_a_torn_line_and_keeps_the_first_of_duplicates(tmp_path):
    source = mixed_conversations()
    journal = tmp_path / "j.jsonl"
    full, _ = regenerate(source, journal, Scripted(), RegenerationOptions(), progress=False)
    first_line, second_line = journal.read_text().splitlines()[:2]
    altered = json.loads(first_line)
    altered["turns"][-1]["content"] = "a later duplicate must lose"
    journal.write_text(f"{first_line}\n{second_line}\n{json.dumps(altered)}\n" + second_line[:25])

    recorder = Recorder(Scripted())
    result, stats = regenerate(source, journal, recorder, RegenerationOptions(), progress=False)
    assert result == full
    assert (stats.conversations_resumed, stats.conversations_done) == (2, 2)
    resumed = {json.loads(first_line)["id"], json.loads(second_line)["id"]}
    asked = {c.id for c in source if any(p[0] == c.messages()[0] for p in recorder.prompts)}
    assert asked == {c.id for c in source} - resumed
    lines = journal.read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line) for line in lines)  # torn tail cut before appending


def test_journal_for_other_data_and_duplicate_input_ids_are_refused(tmp_path):
    journal = tmp_path / "j.jsonl"
    regenerate([conv("a", ("user", "one"))], journal, Scripted(), RegenerationOptions(), progress=False)
    with pytest.raises(JournalError, match="different system/user turns"):
        regenerate([conv("a", ("user", "two"))], journal, Scripted(), RegenerationOptions(), progress=False)
    with pytest.raises(EyasError, match="more than once: 'b'"):
        regenerate([conv("b", ("user", "x")), conv("b", ("user", "y"))], tmp_path / "k.jsonl", Scripted(),
                   RegenerationOptions(), progress=False)
    journal.write_text('{"id": "a", "turns": [}\n')
    with pytest.raises(JournalError, match="line 1"):
        regenerate([conv("a", ("user", "one"))], journal, Scripted(), RegenerationOptions(), progress=False)


def test_progress_bar_runs(tmp_path):
    result, _ = regenerate(mixed_conversations(), tmp_path / "j.jsonl", Scripted(), RegenerationOptions(), progress=True)
    assert len(result) == 4


# --------------------------------------------------------------------------- in-process HF path


@pytest.fixture(scope="module")
def tiny_target():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.loading import load_tokenizer, resolve_target

    tokenizer = load_tokenizer(resolve_target("demo"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval(), tokenizer


def direct_greedy(model, tokenizer, messages, max_new_tokens):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)


def test_hf_regenerates_turn_by_turn_and_matches_model_generate(tiny_target, tmp_path):
    model, tokenizer = tiny_target
    options = RegenerationOptions(max_new_tokens=6, batch_size=4)
    source = mixed_conversations()
    recorder = Recorder(HFGenerator(model, tokenizer, options))
    result, stats = regenerate(source, tmp_path / "j.jsonl", recorder, options, progress=False)
    assert stats.conversations_done == 4 and stats.conversations_failed == 0, stats.failures
    for s, r in zip(source, result, strict=True):
        check_regenerated(s, r)
    multi = result[0]
    second_prompt = next(p for p in recorder.prompts if p[-1]["content"] == "And EAGLE-3?")
    assert second_prompt == multi.messages()[:4] and second_prompt[2]["content"] == multi.turns[2].content
    # Greedy answers are exactly what model.generate gives on the chat-template prompt.
    for conversation in (multi, result[2]):
        for i, turn in enumerate(conversation.turns):
            if turn.regenerated:
                assert turn.content == direct_greedy(model, tokenizer, conversation.messages()[:i], 6)
    assert stats.answers_truncated == stats.turns_generated == 6  # a random model never emits EOS within 6 tokens


def test_hf_batching_gives_the_same_greedy_answers(tiny_target):
    model, tokenizer = tiny_target
    prompts = [[{"role": "user", "content": "word " * n}] for n in (1, 7, 3, 12, 5)]
    one = HFGenerator(model, tokenizer, RegenerationOptions(max_new_tokens=5, batch_size=1)).generate(prompts)
    four = HFGenerator(model, tokenizer, RegenerationOptions(max_new_tokens=5, batch_size=4)).generate(prompts)
    assert all(isinstance(a, Answer) for a in one) and one == four


def test_hf_static_cache_gives_the_same_greedy_answers(tiny_target):
    """The GPU default (a reused StaticCache, widths bucketed, batches filled) answers exactly as the
    dynamic cache does; filler rows never reach the results."""
    model, tokenizer = tiny_target
    prompts = [[{"role": "user", "content": "word " * n}] for n in (1, 7, 3, 12, 5)]
    dynamic = HFGenerator(model, tokenizer, RegenerationOptions(max_new_tokens=5, batch_size=3, static_cache=False))
    static = HFGenerator(model, tokenizer, RegenerationOptions(max_new_tokens=5, batch_size=3, static_cache=True))
    expected = dynamic.generate(prompts)
    assert all(isinstance(a, Answer) for a in expected)
    assert static.generate(prompts) == expected
    assert static.generate(prompts[:2]) == expected[:2]  # a reused cache, reset in between
    assert set(static._static_caches) == {(3, 256 + 5)}  # one shape: both batches filled to 3, one width bucket


def test_hf_sampling_is_reproducible_for_a_seed(tiny_target):
    model, tokenizer = tiny_target
    prompts = [[{"role": "user", "content": "tell me"}]] * 3

    def sample(seed):
        return HFGenerator(model, tokenizer, RegenerationOptions(temperature=1.0, max_new_tokens=5, seed=seed)).generate(prompts)

    assert sample(1) == sample(1) != sample(2)


def test_hf_needs_a_tokenizer_with_a_chat_template(tiny_target, tmp_path):
    import zoo

    model, _ = tiny_target
    with pytest.raises(EyasError, match="ships none"):
        HFGenerator(model, None, RegenerationOptions())
    zoo.llama().save_pretrained(tmp_path)  # weights and config, no tokenizer
    with pytest.raises(EyasError, match="ships none"):
        make_generator(RegenerationOptions(), str(tmp_path))
    with pytest.raises(EyasError, match="regeneration needs a target"):
        make_generator(RegenerationOptions(), None)


# --------------------------------------------------------------------------- fake OpenAI-compatible server


def fake_answer(messages: list[dict]) -> str:
    """Deterministic in the whole prompt, so later answers depend on earlier ones."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:10]
    return f"reply {digest} to {messages[-1]['content']}"


class FakeServer:
    """Loopback OpenAI-compatible server: /models and /chat/completions, with failure knobs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # requests per prompt
        self.bodies: list[dict] = []
        self.fail_each = 0  # each prompt's first N requests get 503
        self.hang_each = 0  # each prompt's first N requests hang for hang_seconds
        self.hang_seconds = 3.0
        self.delay = 0.0
        self.in_flight = self.max_in_flight = 0
        self.release = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def count(self, messages: list[dict]) -> int:
        return self.counts[json.dumps(messages, sort_keys=True)]

    def reset(self):
        with self.lock:
            self.counts.clear()
            self.bodies.clear()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, code: int, payload: dict):
        data = json.dumps(payload).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout test)
            pass

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):
        fake: FakeServer = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        messages = body["messages"]
        key = json.dumps(messages, sort_keys=True)
        with fake.lock:
            fake.counts[key] += 1
            n = fake.counts[key]
            fake.bodies.append(body)
            fake.in_flight += 1
            fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        try:
            if n <= fake.hang_each:
                fake.release.wait(fake.hang_seconds)
            time.sleep(fake.delay)
            last = messages[-1]["content"]
            if n <= fake.fail_each:
                reply = 503, {"error": {"message": "overloaded, try later"}}
            elif "BAD" in last:
                reply = 400, {"error": {"message": "this prompt is malformed"}}
            else:
                content = "" if "EMPTY" in last else fake_answer(messages)
                finish = "length" if "LONG" in last else "stop"
                reply = 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                           "finish_reason": finish}]}
        finally:  # out of flight before the reply goes: a client that has it may send its next request at once,
            with fake.lock:  # before this thread would come back to count this one done
                fake.in_flight -= 1
        self._send(*reply)


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def server_options(fake: FakeServer, **overrides) -> RegenerationOptions:
    return RegenerationOptions(**{"server": fake.url, "concurrency": 4, "retries": 3, "timeout": 5.0, **overrides})


def test_server_path_regenerates_with_the_listed_model_and_sends_the_options(server, tmp_path):
    options = server_options(server, temperature=0.5, max_new_tokens=77, seed=9)
    generator = make_generator(options, None)
    assert isinstance(generator, OpenAIServerGenerator) and generator.model == "fake-model"
    source = mixed_conversations() + [conv("long", ("user", "LONG one"))]
    result, stats = regenerate(source, tmp_path / "j.jsonl", generator, options, progress=False)
    for s, r in zip(source, result, strict=True):
        check_regenerated(s, r)
        for i, turn in enumerate(r.turns):
            if turn.regenerated:  # the answer to exactly the regenerated history before it
                assert turn.content == fake_answer(r.messages()[:i])
    assert (stats.conversations_done, stats.turns_generated, stats.answers_truncated) == (5, 7, 1)
    assert {(b["model"], b["temperature"], b["max_tokens"], b["seed"]) for b in server.bodies} == {("fake-model", 0.5, 77, 9)}


def test_server_retries_503_and_timeouts_then_succeeds(server, tmp_path):
    server.fail_each = 2
    generator = OpenAIServerGenerator(server_options(server), backoff=0.01)
    assert generator.generate([[{"role": "user", "content": "q"}]]) == [Answer(fake_answer([{"role": "user", "content": "q"}]))]
    assert list(server.counts.values()) == [3]

    server.fail_each, server.hang_each = 0, 1
    generator = OpenAIServerGenerator(server_options(server, timeout=0.3), backoff=0.01)
    assert isinstance(generator.generate([[{"role": "user", "content": "slow"}]])[0], Answer)
    assert server.count([{"role": "user", "content": "slow"}]) == 2


def test_server_gives_up_after_retries_and_400_is_not_retried(server, tmp_path):
    server.fail_each = 10
    options = server_options(server, retries=2)
    generator = OpenAIServerGenerator(options, backoff=0.01)
    source = [conv("busy", ("user", "q")), conv("bad", ("user", "BAD input")), conv("empty", ("user", "EMPTY"))]
    result, stats = regenerate(source, tmp_path / "j.jsonl", generator, options, progress=False)
    assert result == [] and stats.conversations_failed == 3
    assert "gave up after 3 attempt(s): HTTP 503: overloaded, try later" in stats.failures[0]
    assert server.count([{"role": "user", "content": "q"}]) == 3

    server.fail_each = 0
    server.reset()
    result, stats = regenerate(source, tmp_path / "j.jsonl", generator, options, progress=False)
    assert [c.id for c in result] == ["busy"]  # the failed one was retried by the rerun
    assert stats.failures[0] == "bad: turn 1: HTTP 400: this prompt is malformed"
    assert stats.failures[1] == "empty: turn 1: empty answer"
    assert server.count([{"role": "user", "content": "BAD input"}]) == 1  # not retried


def test_server_requests_run_concurrently(server):
    server.delay = 0.2
    generator = OpenAIServerGenerator(server_options(server, concurrency=4))
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(8)]
    start = time.perf_counter()
    answers = generator.generate(prompts)
    assert [a.text for a in answers] == [fake_answer(p) for p in prompts]
    # 8 × 0.2 s one at a time takes ≥ 1.6 s; four at a time ~0.4 s (a bound with room for a loaded machine)
    assert 2 <= server.max_in_flight <= 4 and time.perf_counter() - start < 1.6


def test_unreachable_server_raises_a_clear_error():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(EyasError, match=rf"cannot reach .* at {url}/models .*server is running"):
        make_generator(RegenerationOptions(server=url, timeout=2.0), None)


# --------------------------------------------------------------------------- kill and resume


RUNNER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from eyas.data.conversation import Conversation
    from eyas.data.regenerate import OpenAIServerGenerator, RegenerationOptions, regenerate

    url, data, journal, out = sys.argv[1:5]
    source = [Conversation.from_json(d) for d in json.loads(Path(data).read_text())]
    options = RegenerationOptions(server=url, concurrency=4, batch_size=8, retries=0, timeout=10.0)
    result, stats = regenerate(source, Path(journal), OpenAIServerGenerator(options), options, progress=False)
    Path(out).write_text(json.dumps({"conversations": [c.to_json() for c in result], "stats": vars(stats)}))
""")


def resume_source() -> list[Conversation]:
    """30 conversations with 1, 2 or 3 assistant turns, so some finish early in every chunk."""
    source = []
    for i in range(30):
        turns = [("system", f"system {i}")]
        for k in range(i % 3 + 1):
            turns += [("user", f"conversation {i} question {k}"), ("assistant", "old")]
        source.append(conv(f"c{i:02d}", *turns))
    return source


def journal_ids(journal: Path) -> list[str]:
    """Ids on complete lines only (a kill may tear the last one)."""
    return [json.loads(line)["id"] for line in journal.read_text().split("\n")[:-1]]


def conversation_of(body: dict) -> str:
    return "c%02d" % int(body["messages"][0]["content"].split()[1])


def test_kill_at_any_moment_and_rerun_ends_with_every_conversation_once(server, tmp_path):
    source = resume_source()
    reference, _ = regenerate(source, tmp_path / "reference.jsonl", OpenAIServerGenerator(server_options(server)),
                              server_options(server), progress=False)
    assert len(reference) == 30

    script, data = tmp_path / "runner.py", tmp_path / "data.json"
    script.write_text(RUNNER)
    data.write_text(json.dumps([c.to_json() for c in source]))
    journal, out = tmp_path / "journal.jsonl", tmp_path / "out.json"
    command = [sys.executable, str(script), server.url, str(data), str(journal), str(out)]
    server.reset()
    server.delay = 0.1

    first = subprocess.Popen(command)
    deadline = time.monotonic() + 30
    while not (journal.exists() and len(journal_ids(journal)) >= 4):
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended before it could be killed"
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(timeout=10) == -signal.SIGKILL
    journaled = journal_ids(journal)
    assert 4 <= len(journaled) < 30 and len(set(journaled)) == len(journaled)
    unfinished = next(r for r in reference if r.id not in journaled)
    with journal.open("a") as handle:  # as if a kill had torn a line mid-write
        handle.write(json.dumps(unfinished.to_json())[:40])

    time.sleep(0.2)  # let requests the killed run had already sent arrive before we start counting
    server.reset()
    subprocess.run(command, check=True, timeout=60)
    report = json.loads(out.read_text())
    assert [Conversation.from_json(c) for c in report["conversations"]] == reference
    assert sorted(journal_ids(journal)) == [c.id for c in source]  # each exactly once
    assert journal.read_text().endswith("\n")
    stats = report["stats"]
    assert (stats["conversations_resumed"], stats["conversations_done"], stats["conversations_failed"]) == (
        len(journaled), 30 - len(journaled), 0)
    # The rerun asked about exactly the conversations that were not journaled: none twice.
    assert {conversation_of(body) for body in server.bodies} == {c.id for c in source} - set(journaled)
