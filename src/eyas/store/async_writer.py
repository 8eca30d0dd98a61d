"""Write shards on background threads so the accelerator never waits for the disk.

Packing, hashing and writing a shard (hundreds of MB) takes long enough to idle a GPU that
prefills at hundreds of thousands of tokens per second. The capture loop hands each finished
shard to a small thread pool (the heavy parts — memcpy, SHA-256, file writes — release the
GIL) and goes on with the next batch. At most ``max_pending`` shards wait, which bounds memory.
A shard is recorded (``on_written``) only after its file is complete and renamed into place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class ShardWriterPool:
    """Runs ``write()`` calls on worker threads; re-raises the first failure in the caller."""

    def __init__(self, workers: int = 2, max_pending: int = 3):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="eyas-shard-writer")
        self._slots = threading.Semaphore(max_pending)
        self._lock = threading.Lock()  # serialises on_written callbacks (manifest updates)
        self._futures: list[Future] = []

    def submit(self, write: Callable[[], object], on_written: Callable[[object], None]) -> None:
        """Queue ``write``; blocks while ``max_pending`` shards are already waiting."""
        self._raise_failures()
        self._slots.acquire()

        def job():
            try:
                result = write()
                with self._lock:
                    on_written(result)
            finally:
                self._slots.release()

        self._futures.append(self._pool.submit(job))

    def _raise_failures(self) -> None:
        for future in [f for f in self._futures if f.done()]:
            self._futures.remove(future)
            future.result()  # re-raises a writer's exception here, in the capture loop

    def __enter__(self) -> ShardWriterPool:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self._pool.shutdown(wait=True)
        if error is None:
            for future in self._futures:
                future.result()
