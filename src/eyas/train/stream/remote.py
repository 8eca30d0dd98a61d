"""A stream across hosts: the trainer (``eyas train --stream --stream-listen HOST:PORT``) and a producer on the
inference host (``eyas produce --trainer HOST:PORT``) joined by a torch.distributed process group of two over gloo
(TCP; ``GLOO_SOCKET_IFNAME`` picks the network interface), its rendezvous a TCPStore the trainer serves.

The trainer publishes what the producer must capture (the plan: DATA_DIR's manifest SHA-256, the target's identity,
layer ids, token budget, width multiple, dtype, depth) in the store; the producer checks its own DATA_DIR and target
against it, then captures the trainer's batches ahead into a bounded queue (``depth``) on a thread and answers the
trainer's requests (:mod:`eyas.train.stream.wire`). Either side gone ends the other in one line: the trainer after a
checkpoint (``--resume`` continues, with a new producer), the producer at once.
"""

from __future__ import annotations

import datetime
import json
import queue
import threading
from dataclasses import asdict, dataclass

from eyas.errors import EyasError
from eyas.train.stream import wire

SPEC_KEY = "eyas/stream-plan"
TIMEOUT = datetime.timedelta(hours=6)  # one exchange may wait for a large target to load; a peer gone is seen at once


@dataclass(frozen=True)
class Plan:
    """What the trainer asks a remote producer to capture (JSON in the rendezvous store)."""

    data_sha256: str  # DATA_DIR's manifest
    target: dict  # the target's facts that must match (sizes, config SHA-256)
    layer_ids: tuple[int, ...]
    token_budget: int
    multiple: int
    dtype: str
    depth: int
    holdout: bool
    compile_layers: bool = True  # the trainer's --compile-layers: an HF producer's layers compiled on CUDA


def split_address(address: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port), or one line saying what ``flag`` takes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EyasError(f"{flag} {address!r}: give HOST:PORT, e.g. 10.0.0.5:29600")
    return host, int(port)


class RemoteStream:
    """The trainer's end: the same interface as :class:`eyas.train.stream.source.Stream` (start, next_batch, holdout,
    close). It listens when the trainer first asks for data, and waits there for the producer."""

    def __init__(self, address: str, plan: Plan, widths: tuple[int, int], command: str):
        self.host, self.port = split_address(address, "--stream-listen")
        self.plan, self.widths, self.command = plan, widths, command
        self.group = None
        self.lock = threading.Lock()  # one exchange at a time: the prefetching thread's and the evaluation's
        self.started = False

    def _ensure(self) -> None:
        if self.group is not None:
            return
        print(f"stream: waiting for a producer at {self.host}:{self.port}; on the inference host run: {self.command}",
              flush=True)
        try:
            store, self.group = _listen(self.host, self.port, self.plan)
        except RuntimeError as err:
            raise EyasError(f"--stream-listen {self.host}:{self.port}: {_first_line(err)}") from None
        self.store = store  # the rendezvous lives as long as the group it made
        print("stream: the producer joined", flush=True)

    def _exchange(self, op: int, *args: int):
        from eyas.train.stream.source import StreamEnded

        with self.lock:
            self._ensure()
            try:
                wire.send_request(self.group, op, *args)
                answer = wire.receive_answer(self.group, self.plan.dtype, self.widths)
            except RuntimeError as err:  # gloo: the connection is gone
                raise StreamEnded(f"the stream's producer at {self.host}:{self.port} is gone ({_first_line(err)})") \
                    from None
        if isinstance(answer, str):
            raise StreamEnded(f"the stream's producer failed: {answer}")
        return answer

    def start(self, seed: int, epoch: int, index: int, rank: int, world: int) -> None:
        if not self.started:
            self._exchange(wire.START, seed, epoch, index, rank, world)
            self.started = True

    def next_batch(self) -> tuple:
        return self._exchange(wire.NEXT)

    def holdout(self, index: int) -> tuple:
        return self._exchange(wire.HOLDOUT, index)

    def close(self) -> None:
        if self.group is None:
            return
        with self.lock:
            try:
                wire.send_request(self.group, wire.STOP)
            except RuntimeError:
                pass  # already gone
        self.group = None


def _listen(host: str, port: int, plan: Plan):
    import torch.distributed as dist

    store = dist.TCPStore(host, port, 2, True, timeout=TIMEOUT, wait_for_workers=False)
    store.set(SPEC_KEY, json.dumps(asdict(plan)))
    return store, dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__


def serve_trainer(address: str, spec_for, check) -> None:
    """The producer's end: join the trainer at ``address``, read its :class:`Plan`, ``check(plan)`` (raises EyasError
    when this host's DATA_DIR or target is not the trainer's), make the target ready with ``spec_for(plan)`` (a
    context manager yielding what :func:`eyas.train.stream.producer.planned_capture` yields), then answer requests
    until the trainer stops it or is gone."""
    import torch.distributed as dist

    host, port = split_address(address, "--trainer")
    try:
        store = dist.TCPStore(host, port, 2, False, timeout=TIMEOUT)
        fields = json.loads(store.get(SPEC_KEY))
        plan = Plan(**{**fields, "layer_ids": tuple(fields["layer_ids"])})
        group = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)
    except RuntimeError as err:
        raise EyasError(f"--trainer {address}: {_first_line(err)}") from None
    try:
        try:
            check(plan)
        except EyasError as err:  # the trainer hears it as the answer to its first request
            wire.receive_request(group)
            wire.send_error(group, str(err))
            raise
        with spec_for(plan) as (train, held, capture):
            _answer(group, plan, train, held, capture)
    except RuntimeError as err:
        raise EyasError(f"the trainer at {address} is gone ({_first_line(err)})") from None


def _answer(group, plan: Plan, train: tuple, held: tuple, capture) -> None:
    """The request loop, with a thread capturing this rank's batches ahead (at most ``plan.depth``)."""
    from eyas.train.stream.producer import rank_order

    ready: queue.Queue = queue.Queue(maxsize=plan.depth)
    lock, stop = threading.Lock(), threading.Event()  # the target captures one batch at a time

    def ahead(seed, epoch, index, rank, world) -> None:
        try:
            for key in rank_order(train[1], seed, epoch, index, rank, world):
                with lock:
                    item = (key, capture(train, key[2]))
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except Exception as err:  # noqa: BLE001 — the trainer gets it as its next answer
            ready.put(str(err) if isinstance(err, EyasError) else f"{type(err).__name__}: {err}")

    thread = None
    try:
        while True:
            op, a, b, c, d, e = wire.receive_request(group)
            if op == wire.STOP:
                return
            if op == wire.START:
                thread = threading.Thread(target=ahead, args=(a, b, c, d, e), daemon=True, name="eyas-capture-ahead")
                thread.start()
                wire.send_ack(group)
            elif op == wire.NEXT:
                item = ready.get()
                if isinstance(item, str):
                    wire.send_error(group, item)
                    raise EyasError(item)
                wire.send_answer(group, *item)
            elif op == wire.HOLDOUT:
                try:
                    with lock:
                        payload = capture(held, a)
                except EyasError as err:
                    wire.send_error(group, str(err))
                    raise
                wire.send_answer(group, (0, 0, a), payload)
    finally:  # the capturing thread ends before the process does (a C++ call cut off at exit aborts it)
        stop.set()
        if thread is not None:
            thread.join()


def produce(options) -> None:
    """``eyas produce``: the producer's end for ``options`` (:class:`eyas.train.options.ProduceOptions`)."""
    from pathlib import Path

    from eyas.capture.vllm_client import RESERVED_ARGS, parse_vllm_args
    from eyas.train.stream.producer import ProducerSpec, engine_refusal, planned_capture

    data = Path(options.data)
    refusal = engine_refusal(options.engine, options.device, "--device", options.vllm_args, options.vllm_python)
    if refusal:
        raise EyasError(refusal)

    def capturer(plan: Plan):
        return planned_capture(ProducerSpec(
            target=options.target, device=options.device or _default_device(), data=str(data),
            layer_ids=plan.layer_ids, token_budget=plan.token_budget, multiple=plan.multiple, dtype=plan.dtype,
            trust_remote_code=options.trust_remote_code, holdout=plan.holdout, compile_layers=plan.compile_layers,
            engine=options.engine,
            vllm_python=options.vllm_python,
            vllm_engine=parse_vllm_args(options.vllm_args, RESERVED_ARGS) if options.engine == "vllm" else None))

    print(f"produce: joining the trainer at {options.trainer}", flush=True)
    serve_trainer(options.trainer, capturer, lambda plan: _check_inputs(plan, options, data))
    print("produce: the trainer stopped the stream", flush=True)


def _default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _check_inputs(plan: Plan, options, data) -> None:
    """This host's DATA_DIR and target are the trainer's, or one line saying which is not."""
    from eyas.data.fits_target import require_data_fits
    from eyas.io import file_sha256
    from eyas.manifest import MANIFEST, verify_stage_dir
    from eyas.target.facts import target_facts, target_mismatch
    from eyas.target.fingerprint import weights_fingerprint
    from eyas.target.loading import load_target_config

    verify_stage_dir(data, "prepare")
    if file_sha256(data / MANIFEST) != plan.data_sha256:
        raise EyasError(f"--data {data} is not the DATA_DIR the trainer reads (its manifest's SHA-256 differs): give "
                        "this host's copy of the trainer's DATA_DIR")
    require_data_fits(data, options.target, options.trust_remote_code)
    config, source = load_target_config(options.target, options.trust_remote_code)
    mine = {**target_facts(options.target, config, source), **weights_fingerprint(options.target, options.trust_remote_code)}
    problem = target_mismatch(plan.target, mine)
    if problem:
        raise EyasError(f"--target {options.target} is not the trainer's target ({problem}): give this host's copy of it")
