"""The trainer's end of a stream: the producer started and watched, batches taken in order, the holdout on request.

:class:`Stream` spawns the producer (:mod:`eyas.train.stream.producer`) with a bounded batches queue (``depth``) and a
commands queue; :class:`StreamSource` is the training split as the trainer sees any source (``batches`` planned here by
the same rule, ``host_batch`` / ``to_device`` / ``batch``), :class:`StreamHoldout` the holdout split. A producer that
dies, fails or falls silent raises :class:`StreamEnded` with one line saying so; the trainer then checkpoints what it
has and ends (:mod:`eyas.train.trainer`).
"""

from __future__ import annotations

import queue
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.train.stream.producer import ProducerSpec, items, produce, produce_in_thread
from eyas.train.data import host_batch_to_device, padded_host_batch, planned_split

POLL_S = 0.5  # how often a trainer waiting for a batch checks that the producer is alive
STOP_S = 10  # how long a producer asked to stop may take (it stops within one capture)


class StreamEnded(EyasError):
    """The producer is gone (died, failed, or was stopped): no batch will come."""


class Stream:
    """The producer — a process of its own, or with ``thread`` a thread of the trainer's process — and the queues to
    it (one per training process). It starts when the trainer first asks for data, after every check that can refuse
    the run: a refused run leaves no producer behind."""

    def __init__(self, spec: ProducerSpec, depth: int, announce: str = "", thread: bool = False):
        self.spec, self.depth, self.announce, self.thread = spec, depth, announce, thread
        self.process = None  # the producer's process or thread
        self.started = False

    def _ensure(self) -> None:
        """Start the producer (once), and say so."""
        if self.process is not None:
            return
        if self.thread:
            import threading

            self.commands, self.batches, self.holdouts = queue.Queue(), queue.Queue(maxsize=self.depth), queue.Queue()
            self.process = threading.Thread(target=produce_in_thread, name="eyas-stream-producer", daemon=True,
                                            args=(self.spec, self.commands, self.batches, self.holdouts))
            self.process.start()
            print(f"stream: the producer (a thread of the trainer's process) {self.announce}", flush=True)
            return
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")  # CUDA in the producer: never fork a process that may hold a CUDA context
        self.commands = context.Queue()
        self.batches = context.Queue(maxsize=self.depth)
        self.holdouts = context.Queue()
        self.process = context.Process(target=produce, args=(self.spec, self.commands, self.batches, self.holdouts),
                                       name="eyas-stream-producer", daemon=True)
        self.process.start()
        print(f"stream: the producer (pid {self.process.pid}) {self.announce}", flush=True)

    def start(self, seed: int, epoch: int, index: int, rank: int, world: int) -> None:
        """Tell the producer where training starts: it captures from there on, ahead of the trainer."""
        self._ensure()
        if not self.started:
            self.commands.put(("train", seed, epoch, index, rank, world))
            self.started = True

    def receive(self, channel) -> tuple:
        """The next (key, payload) on ``channel`` (batches or holdouts); waits while the producer lives, and raises
        :class:`StreamEnded` once it is gone or has failed."""
        while True:
            try:
                kind, key, body = channel.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise StreamEnded(self._death()) from None
                continue
            except (EOFError, OSError, ConnectionError) as err:  # its end of a queue broke as it died
                raise StreamEnded(f"{self._death()} ({type(err).__name__})") from None
            if kind == "error":
                raise StreamEnded(f"the stream's producer failed: {body}")
            return key, body

    def next_batch(self) -> tuple:
        """The next training batch the producer captured: ((epoch, index, batch), payload)."""
        return self.receive(self.batches)

    def holdout(self, index: int) -> tuple:
        """Holdout batch ``index``, captured now: ((0, 0, index), payload)."""
        self._ensure()
        self.commands.put(("holdout", index))
        return self.receive(self.holdouts)

    def close(self) -> None:
        """Stop the producer (batches it captured ahead are dropped): asked to, then killed if it does not."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(timeout=STOP_S)
        if self.thread:  # a thread still capturing its batch ends with the process (a daemon)
            return
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=30)
        self._remove_leftovers()
        for channel in (self.commands, self.batches, self.holdouts):
            channel.cancel_join_thread()
            channel.close()

    def _remove_leftovers(self) -> None:
        """The vLLM worker's folder a producer killed before it could remove it (at most one batch's files)."""
        import shutil
        import tempfile

        from eyas.train.stream.producer import SHARED_DIR, workdir_prefix

        for folder in Path(SHARED_DIR or tempfile.gettempdir()).glob(workdir_prefix(self.process.pid) + "*"):
            shutil.rmtree(folder, ignore_errors=True)

    def _death(self) -> str:
        if self.thread:  # it puts its failure on the channels before it ends: only a stop ends it silently
            return "the stream's producer thread has stopped"
        self.process.join(timeout=5)
        self._remove_leftovers()
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return f"the stream's producer (pid {self.process.pid}) {how}"


class StreamSource:
    """DATA_DIR's training split, captured by the producer in the trainer's order: the batches of
    :func:`eyas.train.data.planned_split`, each taken from the stream as the trainer asks for it."""

    def __init__(self, stream: Stream, data_dir: Path, split: str, token_budget: int, device: torch.device,
                 dtype: torch.dtype, multiple: int):
        self.stream, self.device, self.dtype, self.multiple = stream, device, dtype, multiple
        samples, self.batches = planned_split(data_dir, split, token_budget, multiple)
        self.ids = [s.id for s in samples]
        self.lengths = [len(s.input_ids) for s in samples]

    def start(self, seed: int, epoch: int, index: int, rank: int, world: int) -> None:
        """Training starts at (epoch, index): the producer captures this rank's share from there on."""
        self.stream.start(seed, epoch, index, rank, world)

    def host_batch(self, index: int) -> dict[str, torch.Tensor]:
        """The next streamed batch, which must be batch ``index`` of the plan, padded on the host (pinned on a GPU)."""
        key, body = self.stream.next_batch()
        if key[2] != index:
            raise EyasError(_out_of_order(f"batch {key[2]} (epoch {key[0]}, index {key[1]})", f"batch {index}"))
        return padded_host_batch(items(body), self.multiple, self.device.type == "cuda")

    def to_device(self, host: dict[str, torch.Tensor]):
        """A :meth:`host_batch` on the training device, decoded by the store's rule."""
        return host_batch_to_device(host, self.device, self.dtype)

    def batch(self, index: int):
        """Batch ``index``: the next one the stream holds."""
        return self.to_device(self.host_batch(index))


class StreamHoldout:
    """DATA_DIR's holdout split, each batch captured by the producer when the evaluation asks for it."""

    def __init__(self, stream: Stream, data_dir: Path, token_budget: int, device: torch.device, dtype: torch.dtype,
                 multiple: int):
        self.stream, self.device, self.dtype, self.multiple = stream, device, dtype, multiple
        samples, self.batches = planned_split(data_dir, "holdout", token_budget, multiple)
        self.lengths = [len(s.input_ids) for s in samples]

    def batch(self, index: int):
        """Holdout batch ``index``, captured now."""
        key, body = self.stream.holdout(index)
        if tuple(key) != (0, 0, index):
            raise EyasError(_out_of_order(f"holdout batch {key[2]}", f"holdout batch {index}"))
        host = padded_host_batch(items(body), self.multiple, self.device.type == "cuda")
        return host_batch_to_device(host, self.device, self.dtype)


def _out_of_order(sent: str, expected: str) -> str:
    return (f"the stream's producer sent {sent}, the trainer expected {expected}: the two plans differ (a bug: report "
            "it with the run's train_options.json)")
