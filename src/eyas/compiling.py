"""How eyas calls ``torch.compile``, once: eager's bf16 rounding kept between fused ops, and the compiled kernels kept
in the eyas cache.

In bf16 every eager op rounds its output to bf16; inductor, fusing ops into one kernel, keeps what is between them in
fp32 unless told to round there too (``emulate_precision_casts``). The unrounded kernels are no more wrong, but they
are different, and eyas compiles only where the result must be the eager forward's arithmetic: the engine's decoding
rounds (:func:`eyas.engine.graphs.compiled`) and capture's decoder layers (:func:`eyas.target.capture.fused_decoder_layers`).
The training loss's chunk functions (:mod:`eyas.families.eagle3.loss`), whose arithmetic is fp32, are compiled here
without it.

One compiled call at a time in a process. torch.compile traces a function it compiles with FX, and while it does, two
things are process-wide: the flag that says "FX is tracing" and ``nn.Module.__call__``, which FX patches. A compiled
function called from another thread in that time refuses to run ("Detected that you are using FX to symbolically trace
a dynamo-optimized function"): a producer thread capturing beside the trainer (``train --stream --stream-producer
thread``) died so when the trainer compiled its loss (an H100 run, 2026-12-07). Every function compiled here therefore
runs under one lock: a compilation happens only inside such a call, so no other thread's compiled call runs while it
traces, and a compiled call costs the other thread at most the wait for one call (a layer's or a loss chunk's kernel
launches; a whole compilation only while one is under way). The lock is handed over in the order it was asked for:
with Python's own, a thread that releases it takes it straight back, and the producer calling its 30 compiled layers
in a row kept the trainer's loss waiting through a whole forward (12 ms a step on an H100:
benchmarks/results/2026-12-07_h100_stream-4).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Callable


class FairLock:
    """A reentrant lock that waiting threads get in the order they asked for it (first come, first served)."""

    def __init__(self):
        self._changed = threading.Condition(threading.Lock())
        self._owner, self._depth = None, 0
        self._waiting: collections.deque[int] = collections.deque()

    def __enter__(self) -> FairLock:
        me = threading.get_ident()
        with self._changed:
            if self._owner == me:
                self._depth += 1
                return self
            self._waiting.append(me)
            while self._owner is not None or self._waiting[0] != me:
                self._changed.wait()
            self._waiting.popleft()
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._changed.notify_all()


_ONE_AT_A_TIME = FairLock()  # every call of a function compiled here holds it (the module's note)


def compiled(fn: Callable, dynamic: bool, keep_rounding: bool = True) -> Callable:
    """``fn`` under torch.compile, called under the process's one compile lock (the module's note); ``dynamic``: one
    graph for every input shape (inductor's kernels take the sizes as arguments) rather than one per shape;
    ``keep_rounding``: eager's bf16 rounding kept between fused ops."""
    import torch

    use_persistent_compile_cache()
    fused = torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True} if keep_rounding else None)

    @functools.wraps(fn)
    def one_at_a_time(*args, **kwargs):
        with _ONE_AT_A_TIME:
            return fused(*args, **kwargs)

    return one_at_a_time


def use_persistent_compile_cache() -> None:
    """Keep torch.compile's caches (FX graphs, Triton kernels) in the eyas cache, ``$EYAS_CACHE/inductor``, unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: a later process that compiles the same code on the same GPU and torch
    loads the compiled kernels instead of compiling them again (torch's default lives under /tmp)."""
    from eyas.io import cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
