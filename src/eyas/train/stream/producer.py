"""The producer's process: the target on its device, DATA_DIR's batches captured in the trainer's order.

It waits for the trainer's commands on one queue: ``("stop",)``, ``("holdout", b)`` (capture holdout batch ``b`` now, answered on the
holdout queue) and ``("train", seed, epoch, index, rank, world)`` (from that data position on, capture this rank's
share of the global batch order — :func:`eyas.train.data.batches_forever` — into the batches queue, at most
``depth`` ahead of the trainer: a full queue holds the producer back, serving holdout requests while it waits).
Everything it sends is ``(kind, key, payload)``: ``("train", (epoch, index, batch), payload)``,
``("holdout", (0, 0, b), payload)``, or ``("error", None, one line)`` when it fails. It dies with the trainer (the parent's
death signal on Linux, and a check of its parent while it waits).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from eyas.errors import EyasError

WAIT_S = 0.1  # how often a waiting producer checks for requests and for its parent


SHARED_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where the vLLM worker's per-sample files live


def workdir_prefix(pid: int) -> str:
    """The name a vLLM producer's folder starts with: its trainer removes what a killed producer left."""
    return f"eyas-stream-{pid}-"


def engine_refusal(engine: str, device, device_flag: str, vllm_args, vllm_python) -> str | None:
    """What is wrong with a producer's engine options (``device_flag``: how its HF device is spelled), or None."""
    if engine == "vllm" and device is not None:
        return (f"{device_flag} places the target loaded with HF; vLLM places its own (--vllm-arg "
                "tensor_parallel_size=8, CUDA_VISIBLE_DEVICES): leave it out with the vllm engine")
    if engine == "hf" and (vllm_args or vllm_python):
        return "--vllm-arg and --vllm-python configure the vllm engine; this producer uses HF"
    return None


@dataclass(frozen=True)
class ProducerSpec:
    """What the producer captures: the target (and where), DATA_DIR, the taps, the batches' plan and the storage
    dtype (picklable: it crosses to the spawned process)."""

    target: str
    device: str
    data: str
    layer_ids: tuple[int, ...]
    token_budget: int
    multiple: int
    dtype: str
    trust_remote_code: bool
    holdout: bool
    compile_layers: bool = True  # on CUDA, the HF capture's decoder layers compiled (eyas.target.capture)
    engine: str = "hf"  # or vllm: eyas' vLLM capture worker (:class:`eyas.capture.vllm_client.VllmSession`)
    vllm_python: str | None = None
    vllm_engine: dict | None = None  # the LLM(...) arguments asked for


def payload(pack, share: bool = True) -> dict:
    """A captured :class:`eyas.store.shards.Pack` as it travels: its host tensors (in shared memory when ``share``, for
    a queue to another process; as they are for a thread of the trainer's) and each sample's length."""
    if pack.ready is not None:  # copies from the GPU still in flight
        pack.ready.synchronize()
    return {"lengths": list(pack.lengths),
            "tensors": {name: _shared(t) if share else t for name, t in pack.tensors.items()}}


def _shared(tensor):
    """``tensor`` in shared memory, where the queue hands it over without another copy (page-locked memory, which a
    capture on a GPU copies into, cannot be shared: it is copied once into a shared tensor)."""
    import torch

    if not tensor.is_pinned():
        return tensor.share_memory_()
    shared = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    shared.copy_(tensor)
    return shared


def items(message: dict) -> list[dict]:
    """A :func:`payload` as per-sample dicts in storage form (views, no copy): what a store's rows look like."""
    out, start = [], 0
    for length in message["lengths"]:
        out.append({name: tensor[start:start + length] for name, tensor in message["tensors"].items()})
        start += length
    return out


def produce(spec: ProducerSpec, commands, batches, holdouts) -> None:
    """The producer process's body (spawned by :class:`eyas.train.stream.source.Stream`)."""
    _die_with_parent()
    parent = os.getppid()
    try:
        _serve(spec, commands, batches, holdouts, lambda: os.getppid() == parent, thread=False)
    except (_ParentGone, _Stopped):
        return
    except BaseException as err:
        line = _failure(err)
        for channel in (holdouts, batches):  # the holdouts first: unbounded, while a full batches queue would block
            channel.put(("error", None, line))
            channel.close()
            channel.join_thread()
        sys.exit(1)


def produce_in_thread(spec: ProducerSpec, commands, batches, holdouts) -> None:
    """The producer as a thread of the trainer's process (``--stream-producer thread``): the same loop, its capture on
    a CUDA stream of its own, the host tensors handed over as they are."""
    try:
        _serve(spec, commands, batches, holdouts, lambda: True, thread=True)
    except _Stopped:
        return
    except BaseException as err:
        line = _failure(err)
        for channel in (holdouts, batches):  # as a process's
            channel.put(("error", None, line))


def _failure(err: BaseException) -> str:
    """One line for the trainer (it ends the run with it: whichever channel it waits on says it); the trace on stderr."""
    traceback.print_exc(file=sys.stderr)
    return str(err) if isinstance(err, EyasError) else f"{type(err).__name__}: {err}"


class _ParentGone(Exception):
    pass


class _Stopped(Exception):
    pass


def _serve(spec: ProducerSpec, commands, batches, holdouts, alive, thread: bool) -> None:
    import torch

    torch.set_grad_enabled(False)  # this thread's: a producer thread leaves the trainer's as it is
    side = torch.cuda.Stream(torch.device(spec.device)) if thread and spec.device.startswith("cuda") else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext(), \
            planned_capture(spec, share=not thread) as (train, held, capture):
        _Producer(capture, commands, batches, holdouts, alive, train, held).run()


@contextlib.contextmanager
def planned_capture(spec: ProducerSpec, share: bool = True):
    """DATA_DIR planned as the trainer plans it and the target ready → (the train split, the holdout split — each
    (samples, batches) of :func:`eyas.train.data.planned_split` —, capture(split, batch) → :func:`payload`); the target
    let go (a vLLM worker stopped) on leaving. Every producer's: a process's, a thread's, ``eyas produce``'s."""
    from eyas.train.data import planned_split

    train = planned_split(spec.data, "train", spec.token_budget, spec.multiple)
    held = planned_split(spec.data, "holdout", spec.token_budget, spec.multiple) if spec.holdout else ([], [])
    with _capturer(spec, max(len(s.input_ids) for s in [*train[0], *held[0]])) as capture_rows:
        yield train, held, lambda split, batch: payload(capture_rows([split[0][i] for i in split[1][batch]]), share)


def rank_order(batches: list, seed: int, epoch: int, index: int, rank: int, world: int):
    """(epoch, index, batch) of the global batch order (:func:`eyas.train.data.batches_forever`) from (epoch, index) on
    that rank ``rank`` of ``world`` takes: every world-th from its place (a step's micro-batches are dealt so)."""
    from eyas.train.data import batches_forever

    for position, item in enumerate(batches_forever(_Plan(batches), seed, epoch, index)):
        if position % world == rank:
            yield item


class _Producer:
    """The producer's loop: holdout requests until training starts, then this rank's batches in order, each put into
    the bounded queue once there is room (requests answered while it waits)."""

    def __init__(self, capture, commands, batches, holdouts, alive, train: tuple, held: tuple):
        self.capture, self.commands, self.batches, self.holdouts = capture, commands, batches, holdouts
        self.alive, self.train, self.held = alive, train, held  # alive(): the trainer is still there
        self.captured, self.tokens, self.capture_s, self.room_s = 0, 0, 0.0, 0.0  # training batches: its one line

    def run(self) -> None:
        start = None
        while start is None:  # holdout requests (the step-0 evaluation) until the trainer says where training starts
            start = self.serve(self.next_command(block=True))
        for key in rank_order(self.train[1], *start[1:]):
            self.serve_pending()  # an evaluation waits for no training batch
            began = time.perf_counter()
            message = ("train", key, self.capture(self.train, key[2]))
            captured = time.perf_counter()
            self.captured, self.tokens = self.captured + 1, self.tokens + sum(message[2]["lengths"])
            while True:  # back-pressure: wait for room, answering holdout requests meanwhile
                try:
                    self.batches.put(message, timeout=WAIT_S)
                    break
                except queue.Full:
                    self.serve_pending()
            self.capture_s, self.room_s = self.capture_s + captured - began, self.room_s + time.perf_counter() - captured

    def serve(self, command) -> tuple | None:
        """Answer a holdout request; a train command is returned to the caller; a stop ends the producer."""
        if command[0] == "stop":
            if hasattr(self.batches, "cancel_join_thread"):  # a process's queue: what it captured ahead is dropped,
                self.batches.cancel_join_thread()  # exit without waiting for a reader
            if self.captured:  # where a stream's time went: capturing, or waiting for the trainer to take batches
                print(f"stream: the producer captured {self.captured} training batches ({self.tokens:,} tokens) in "
                      f"{self.capture_s:.1f} s ({self.tokens / max(self.capture_s, 1e-9):,.0f} tokens/s) and waited "
                      f"{self.room_s:.1f} s for room in the buffer", file=sys.stderr, flush=True)
            raise _Stopped
        if command[0] == "holdout":
            self.holdouts.put(("holdout", (0, 0, command[1]), self.capture(self.held, command[1])))
            return None
        return command

    def serve_pending(self) -> None:
        while (pending := self.next_command(block=False)) is not None:
            self.serve(pending)

    def next_command(self, block: bool):
        """The trainer's next command (None when none waits and ``block`` is off); a trainer gone ends the producer."""
        while True:
            try:
                return self.commands.get(timeout=WAIT_S) if block else self.commands.get_nowait()
            except queue.Empty:
                if not self.alive():
                    raise _ParentGone from None
                if not block:
                    return None


@contextlib.contextmanager
def _capturer(spec: ProducerSpec, longest: int):
    """A function rows → :class:`eyas.store.shards.Pack` of ``spec.dtype``: the target loaded with HF, or a vLLM
    worker session (stopped, its files removed, when the producer ends)."""
    if spec.engine == "hf":
        from eyas.capture.batch import capture_batch
        from eyas.target import load_target

        target = load_target(spec.target, device=spec.device, trust_remote_code=spec.trust_remote_code)
        yield lambda rows: capture_batch(target, rows, spec.layer_ids, spec.dtype, spec.compile_layers)
        return
    import tempfile

    from eyas.capture.batch import pack_rows
    from eyas.capture.vllm_client import VllmSession
    from eyas.target.loading import load_target_config

    config, _ = load_target_config(spec.target, spec.trust_remote_code)
    layers = int(getattr(config, "text_config", config).num_hidden_layers)
    workdir = tempfile.mkdtemp(prefix=workdir_prefix(os.getpid()), dir=SHARED_DIR)
    session = VllmSession(spec.target, spec.layer_ids, layers, spec.vllm_python, workdir, spec.vllm_engine, longest + 8)
    try:
        yield lambda rows: pack_rows(rows, session.capture([(r.id, r.input_ids) for r in rows]), spec.dtype,
                                    len(spec.layer_ids))
    finally:
        session.close()


@dataclass
class _Plan:
    batches: list


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this process when the trainer dies (kill -9 included)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
