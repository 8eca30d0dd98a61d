"""Capture hidden states through vLLM, for targets too large to load with HF.

vLLM runs in its own environment (it pins its own torch), so eyas drives it as a subprocess:
``vllm_worker.py`` runs under the vLLM Python, captures every sample with vLLM's
``extract_hidden_states`` speculative method and writes one safetensors file per sample plus an
``index.jsonl``; this module writes the requests, streams the worker's log to the user, and
yields each sample's states in eyas' form as soon as its file lands.

vLLM's layer ids mean what eyas' mean (id ``L`` = the residual stream entering decoder layer
``L``; id ``N`` = the last layer's output before the final norm), so they are passed as is. The
final hidden, though, is the final norm's *output*, which vLLM never exposes: the worker always
taps id ``N`` as well, and the norm is applied here, loaded on its own from the checkpoint so a
huge target is never loaded whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eyas.capture.options import VLLM_ARGS
from eyas.errors import EyasError
from eyas.io import atomic_path
from eyas.target.layer_ids import validate_layer_ids
from eyas.target.loading import resolve_target
from eyas.target.taps import Taps
from eyas.target.weights import load_final_norm

WORKER = Path(__file__).with_name("vllm_worker.py")
_LOG_TAIL = 40  # worker log lines quoted in an error
_POLL_S = 0.2
ENGINE_FILE = "engine.json"  # the worker's record of its LLM(...) arguments (vllm_worker.ENGINE_FILE)


def resolve_vllm_python(explicit: str | None = None) -> str:
    """The Python to run vLLM with: ``explicit`` (``--vllm-python``), else $EYAS_VLLM_PYTHON."""
    for candidate in (explicit, os.environ.get("EYAS_VLLM_PYTHON")):
        if candidate:
            return candidate
    raise EyasError(
        "running vLLM (capture or bench --engine vllm) needs a Python environment that has vLLM: pass --vllm-python "
        "/path/to/venv/bin/python or set EYAS_VLLM_PYTHON to it. `benchmarks/vllm_env.sh setup` builds one with vLLM's CPU build "
        "(any venv with `pip install vllm` will do)"
    )


def check_vllm_python(python: str) -> None:
    """Fail with a clear message unless ``python`` runs and can find the vllm package."""
    # find_spec, not `import vllm`: the import takes seconds; a broken install still fails later,
    # in the worker, with its log.
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EyasError(f"cannot run the vLLM Python {python!r}: {err}; set EYAS_VLLM_PYTHON to a working one") from err
    if done.returncode == 3:
        raise EyasError(
            f"{python} cannot import vllm; install it there (`{python} -m pip install vllm`, or "
            "`benchmarks/vllm_env.sh setup` for the CPU build) or point EYAS_VLLM_PYTHON at a Python that has it"
        )
    if done.returncode != 0:
        raise EyasError(f"the vLLM Python {python!r} failed to start: {done.stderr.strip()[-500:]}")


# LLM(...) arguments the worker sets itself: the capture depends on them, so --vllm-arg may not change them.
RESERVED_ARGS = ("model", "speculative_config", "kv_transfer_config", "enable_chunked_prefill", "enable_prefix_caching",
                 "max_model_len", "skip_tokenizer_init")


def engine_request(options) -> dict:
    """The LLM(...) arguments the user asked for (capture options; None = the worker's default): the named options,
    then each ``--vllm-arg KEY=VALUE``."""
    request = {key: getattr(options, name) for key, name in VLLM_ARGS.items()}
    if request["compilation_config"] is not None:
        request["compilation_config"] = json.loads(request["compilation_config"])
    return {**request, **parse_vllm_args(options.vllm_args, RESERVED_ARGS, VLLM_ARGS)}


def parse_vllm_args(items: list[str], reserved: tuple[str, ...] = (), named: dict[str, str] | None = None) -> dict:
    """``--vllm-arg KEY=VALUE`` items as LLM(...) arguments, VALUE parsed as JSON where it parses; a ``reserved`` key
    (eyas sets it) or one with its own option (``named``: LLM(...) name → option name) is refused."""
    named = named or {}
    out: dict = {}
    for item in items:
        key, _, text = item.partition("=")
        key = key.strip()
        if key in reserved:
            raise EyasError(f"--vllm-arg {item!r}: eyas sets {key} itself; leave it out")
        if key in named:
            raise EyasError(f"--vllm-arg {item!r}: use --{named[key].replace('_', '-')} for {key}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def worker_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The ids the worker taps: the aux ids, then ``N`` (for the final hidden) unless already there."""
    ids = validate_layer_ids(layer_ids, num_layers)
    return ids if ids[-1] == num_layers else (*ids, num_layers)


def write_requests(samples: Iterable[tuple[str, np.ndarray]], path: Path) -> list[tuple[str, np.ndarray]]:
    """Write the worker's requests file (one JSON line per sample); returns the samples as a list."""
    requests: list[tuple[str, np.ndarray]] = []
    seen: set[str] = set()
    with atomic_path(Path(path)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for sample_id, input_ids in samples:
            sample_id = str(sample_id)
            ids = np.asarray(input_ids)
            if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise EyasError(f"sample {sample_id!r}: input_ids must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
            if sample_id in seen:
                raise EyasError(f"sample id {sample_id!r} appears twice; vLLM capture names its files by id")
            seen.add(sample_id)
            f.write(json.dumps({"id": sample_id, "input_ids": ids.tolist()}) + "\n")
            requests.append((sample_id, ids))
    return requests


class IndexReader:
    """Reads the worker's ``index.jsonl`` incrementally, only ever parsing complete lines."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.entries: dict[str, dict] = {}

    def poll(self) -> dict[str, dict]:
        """Add the lines finished since the last poll; returns all entries by id."""
        if not self.path.exists():
            return self.entries
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        for line in complete.decode("utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                self.entries[record["id"]] = record
        return self.entries


def load_worker_states(states_dir: Path, entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's (hidden_states [T, m, H], token_ids [T]) as the worker wrote them."""
    from safetensors.torch import load_file

    data = load_file(str(Path(states_dir) / entry["file"]))
    return data["hidden_states"], data["token_ids"]


def split_states(
    hidden: torch.Tensor, tapped: tuple[int, ...], taps: Taps, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker states [T, m, H] at ids ``tapped`` → (aux [T, k·H] in the taps' slots, final [T, H] = norm(id N))."""
    aux = taps.assemble(hidden, tapped)
    with torch.no_grad():
        final = norm(hidden[:, tapped.index(taps.num_layers)])  # the final norm's input is id N
    return aux, final


class _Worker:
    """The worker subprocess, its log forwarded to our stderr and its tail kept for errors."""

    def __init__(self, command: list[str], requests_on_stdin: bool = False):
        self.tail: deque[str] = deque(maxlen=_LOG_TAIL)
        # Own session: on cleanup the worker and the engine processes vLLM starts go together.
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
            stdin=subprocess.PIPE if requests_on_stdin else None,
        )
        self._reader = threading.Thread(target=self._forward, daemon=True)
        self._reader.start()

    def _forward(self) -> None:
        for line in self.process.stdout:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
        sys.stderr.flush()

    def returncode(self) -> int | None:
        """The exit status once it has exited (its log fully read), else None."""
        code = self.process.poll()
        if code is not None:
            self._reader.join(timeout=10)
        return code

    def log_tail(self) -> str:
        return "\n".join(self.tail)

    def stop(self) -> None:
        """End the worker's whole session if it still runs (TERM, then KILL after 30 s)."""
        if self.process.poll() is None:
            _signal_session(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_session(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._reader.join(timeout=10)


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the worker leads its own session: pgid == its pid
    except ProcessLookupError:
        pass


def _worker_inputs(target_source: str, layer_ids: tuple[int, ...], num_layers: int, vllm_python: str | None) -> tuple:
    """What a vLLM worker is started with and its states are read by: (the vLLM Python, checked; the target's
    checkpoint; the ids it taps; the taps; the final norm, loaded on its own)."""
    python = resolve_vllm_python(vllm_python)
    check_vllm_python(python)
    source = resolve_target(target_source)
    return (python, source, worker_layer_ids(tuple(layer_ids), num_layers), Taps(layer_ids, num_layers),
            load_final_norm(source, num_layers))


def capture_with_vllm(
    samples: Iterable[tuple[str, np.ndarray]],
    target_source: str,
    layer_ids: tuple[int, ...],
    num_layers: int,
    vllm_python: str | None,
    workdir: Path,
    engine: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Yield ``(sample_id, aux [T, k·H], final [T, H])`` per sample, in order, captured by vLLM.

    ``samples`` are ``(sample_id, input_ids)`` with unique ids; ``engine``: the LLM(...) arguments asked for
    (:func:`engine_request`; the worker fills in the rest). ``workdir`` keeps the requests,
    the worker's files and its index; a rerun with the same workdir skips what was captured, and a failure before any
    sample was captured leaves none of them behind. Raises EyasError (with the worker's log tail) if vLLM fails or
    returns other tokens.
    """
    python, source, tapped, taps, norm = _worker_inputs(target_source, layer_ids, num_layers, vllm_python)
    workdir = Path(workdir)
    states_dir = workdir / "states"
    index = IndexReader(states_dir / "index.jsonl")
    try:
        requests = write_requests(samples, workdir / "requests.jsonl")
        command = [
            python, str(WORKER), "--model", source, "--requests", str(workdir / "requests.jsonl"),
            "--layer-ids", ",".join(map(str, tapped)), "--out", str(states_dir), "--engine-args", json.dumps(engine or {}),
        ]  # fmt: skip
        worker = _Worker(command)
    except BaseException:
        _discard_if_nothing_captured(workdir, index)
        raise
    try:
        for sample_id, input_ids in requests:
            entry = _wait_for(sample_id, index, worker)
            hidden, tokens = load_worker_states(states_dir, entry)
            if not np.array_equal(tokens.numpy(), input_ids):
                raise EyasError(
                    f"sample {sample_id!r}: the states in {states_dir / entry['file']} are for other tokens "
                    f"({tokens.numel()} vs {input_ids.size}); the workdir holds a capture of other data: "
                    "empty it or use another one"
                )
            aux, final = split_states(hidden, tapped, taps, norm.to(hidden.dtype))
            yield sample_id, aux, final
        code = worker.process.wait()
        worker.returncode()
        if code != 0:
            raise EyasError(f"the vLLM worker exited with status {code} after capturing every sample:\n{worker.log_tail()}")
    except BaseException:
        worker.stop()
        _discard_if_nothing_captured(workdir, index)
        raise
    finally:
        worker.stop()  # also when the consumer stops early: no vLLM process outlives the generator


class VllmSession:
    """A vLLM worker kept running for requests sent as they are needed (its ``--requests -``): the producer of a stream
    (:mod:`eyas.train.stream`) asks it for one batch of samples at a time, so vLLM captures no further ahead than the
    trainer's buffer allows. Each sample's file is deleted once read: ``workdir`` (in shared memory where the host has
    it) holds one batch at most."""

    def __init__(self, target_source: str, layer_ids: tuple[int, ...], num_layers: int, vllm_python: str | None,
                 workdir: Path, engine: dict | None, max_model_len: int):
        python, source, self.tapped, self.taps, self.norm = _worker_inputs(target_source, layer_ids, num_layers,
                                                                           vllm_python)
        self.states_dir = Path(workdir) / "states"
        self.index = IndexReader(self.states_dir / "index.jsonl")
        self.sent = 0  # requests sent: each gets a fresh id, as a sample recurs every epoch
        command = [
            python, str(WORKER), "--model", source, "--requests", "-", "--max-model-len", str(max_model_len),
            "--layer-ids", ",".join(map(str, self.tapped)), "--out", str(self.states_dir),
            "--engine-args", json.dumps(engine or {}),
        ]  # fmt: skip
        self.worker = _Worker(command, requests_on_stdin=True)

    def capture(self, samples: list[tuple[str, np.ndarray]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each sample's (aux [T, k·H], final [T, H]), captured in one generate() call, in order."""
        names = []
        for sample_id, input_ids in samples:
            names.append(f"{self.sent}:{sample_id}")
            self.sent += 1
            self._send(json.dumps({"id": names[-1], "input_ids": np.asarray(input_ids).tolist()}) + "\n")
        self._send("\n")  # the group ends: capture it now
        out = []
        for name, (sample_id, input_ids) in zip(names, samples, strict=True):
            entry = _wait_for(name, self.index, self.worker)
            hidden, tokens = load_worker_states(self.states_dir, entry)
            (self.states_dir / entry["file"]).unlink()
            if not np.array_equal(tokens.numpy(), np.asarray(input_ids)):
                raise EyasError(f"sample {sample_id!r}: vLLM returned states for other tokens ({tokens.numel()} vs "
                                f"{len(input_ids)})")
            out.append(split_states(hidden, self.tapped, self.taps, self.norm.to(hidden.dtype)))
        return out

    def _send(self, text: str) -> None:
        try:
            self.worker.process.stdin.write(text)
            self.worker.process.stdin.flush()
        except (BrokenPipeError, OSError):
            code = self.worker.process.wait(timeout=30)
            raise EyasError(f"the vLLM worker exited (status {code}); the end of its log:\n{self.worker.log_tail()}") \
                from None

    def close(self) -> None:
        """End the worker and remove its files."""
        with contextlib.suppress(OSError):
            self.worker.process.stdin.close()
        self.worker.stop()
        shutil.rmtree(self.states_dir.parent, ignore_errors=True)


def _discard_if_nothing_captured(workdir: Path, index: IndexReader) -> None:
    """After a failure, remove what a run that captured no sample wrote in ``workdir`` (the requests, the worker's
    folder), and ``workdir`` itself once empty: nothing there to resume from (a vLLM that failed to start, say)."""
    try:
        if index.poll():
            return
    except (OSError, ValueError):  # an index that cannot be read is left as it is, for the rerun to judge
        return
    (workdir / "requests.jsonl").unlink(missing_ok=True)
    shutil.rmtree(index.path.parent, ignore_errors=True)
    with contextlib.suppress(OSError):
        workdir.rmdir()


def engine_used(workdir: Path) -> dict | None:
    """Every LLM(...) argument the worker ran vLLM with and the defaults it chose (its ``engine.json``), or None
    before it wrote one."""
    path = Path(workdir) / "states" / ENGINE_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _wait_for(sample_id: str, index: IndexReader, worker: _Worker) -> dict:
    """Block until the worker lists ``sample_id``; raise if it exits without doing so."""
    while True:
        if sample_id in index.poll():
            return index.entries[sample_id]
        code = worker.returncode()
        if code is not None:
            if sample_id in index.poll():  # written just before it exited
                return index.entries[sample_id]
            if code != 0:
                raise EyasError(f"the vLLM worker failed (exit status {code}); the end of its log:\n{worker.log_tail()}")
            raise EyasError(f"the vLLM worker finished without capturing sample {sample_id!r}:\n{worker.log_tail()}")
        time.sleep(_POLL_S)
