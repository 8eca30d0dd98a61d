"""How eyas calls ``torch.compile``, once: eager's bf16 rounding kept between fused ops, and the compiled kernels kept
in the eyas cache.

In bf16 every eager op rounds its output to bf16; inductor, fusing ops into one kernel, keeps what is between them in
fp32 unless told to round there too (``emulate_precision_casts``). The unrounded kernels are no more wrong, but they
are different, and eyas compiles only where the result must be the eager forward's arithmetic: the engine's decoding
rounds (:func:`eyas.engine.graphs.compiled`) and capture's decoder layers (:func:`eyas.target.capture.fused_decoder_layers`).
The training loss's chunk functions (:mod:`eyas.families.eagle3.loss`), whose arithmetic is fp32, are compiled here
without it.

Compiled calls side by side, a compilation alone. torch.compile traces a function it compiles with FX, and while it
does, two things are process-wide: the flag that says "FX is tracing" and ``nn.Module.__call__``, which FX patches. A
compiled function called from another thread in that time refuses to run ("Detected that you are using FX to
symbolically trace a dynamo-optimized function"): a producer thread capturing beside the trainer (``train --stream
--stream-producer thread``) died so when the trainer compiled its loss (an H100 run, 2026-12-07). Every call of a
function compiled here therefore goes through one gate (:class:`CompileGate`): calls that find their compiled code run
side by side, under dynamo's stance "fail_on_recompile"; a call that would compile is refused before it runs anything,
and runs again alone, once every call under way has ended and before any other starts. The stance is process-wide:
while calls run side by side, a function compiled elsewhere than here would be refused too (eyas compiles nowhere
else: tests/test_compiling.py). A lock around every call (one compiled call at a time) was tried first, and cost more
than the compilations it guarded: the producer's 30 layer calls a batch and the trainer's loss calls took turns
through it, and each turn waited for the other thread to give up Python's GIL — 12 ms of idle GPU a step with Python's
RLock, 26-46 ms handed over first come first served (H100, benchmarks/results/2026-12-07_h100_stream-4 and
2026-12-07_h100_stream-5).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable


REFUSED = "Detected recompile when torch.compile stance is 'fail_on_recompile'"  # how dynamo refuses a compilation


class CompileGate:
    """Compiled calls side by side, a compilation alone (the module's note). :meth:`call` runs a compiled function's call
    with the others under way, dynamo told to refuse compiling; refused, the call waits until no other runs, and runs
    alone, free to compile. A compiled function that calls another runs that call as its own part."""

    def __init__(self):
        self._changed = threading.Condition(threading.Lock())
        self._running = 0  # calls under way side by side
        self._alone = False  # a call runs alone (it may compile)
        self._queued = 0  # threads waiting to run alone: no call starts before them
        self._stance = None  # the set_stance that refuses compilations while calls run side by side
        self._mine = threading.local()  # this thread's calls under way

    def call(self, fused: Callable, *args, **kwargs):
        """``fused(*args, **kwargs)``, beside the other threads' compiled calls unless it must compile."""
        if getattr(self._mine, "depth", 0):  # inside this thread's own compiled call: part of it
            return self._run(fused, args, kwargs)
        self._enter_beside()
        try:
            return self._run(fused, args, kwargs)
        except RuntimeError as err:
            if REFUSED not in str(err):
                raise
        finally:
            self._leave_beside()
        self._enter_alone()
        try:
            return self._run(fused, args, kwargs)
        finally:
            self._leave_alone()

    def _run(self, fused: Callable, args: tuple, kwargs: dict):
        self._mine.depth = getattr(self._mine, "depth", 0) + 1
        try:
            return fused(*args, **kwargs)
        finally:
            self._mine.depth -= 1

    def _enter_beside(self) -> None:
        with self._changed:
            while self._alone or self._queued:
                self._changed.wait()
            if self._running == 0:  # the first of the calls side by side: compilations refused from now on
                import torch

                self._stance = torch.compiler.set_stance("fail_on_recompile")
            self._running += 1

    def _leave_beside(self) -> None:
        with self._changed:
            self._running -= 1
            if self._running == 0:  # the last: the stance it found, back
                self._stance.__exit__(None, None, None)
                self._stance = None
                self._changed.notify_all()

    def _enter_alone(self) -> None:
        with self._changed:
            self._queued += 1
            while self._alone or self._running:
                self._changed.wait()
            self._queued -= 1
            self._alone = True

    def _leave_alone(self) -> None:
        with self._changed:
            self._alone = False
            self._changed.notify_all()


_GATE = CompileGate()  # every call of a function compiled here goes through it (the module's note)


def compiled(fn: Callable, dynamic: bool, keep_rounding: bool = True) -> Callable:
    """``fn`` under torch.compile, called through the process's one gate (the module's note); ``dynamic``: one
    graph for every input shape (inductor's kernels take the sizes as arguments) rather than one per shape;
    ``keep_rounding``: eager's bf16 rounding kept between fused ops."""
    import torch

    use_persistent_compile_cache()
    fused = torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True} if keep_rounding else None)

    @functools.wraps(fn)
    def through_the_gate(*args, **kwargs):
        return _GATE.call(fused, *args, **kwargs)

    return through_the_gate


def use_persistent_compile_cache() -> None:
    """Keep torch.compile's caches (FX graphs, Triton kernels) in the eyas cache, ``$EYAS_CACHE/inductor``, unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: a later process that compiles the same code on the same GPU and torch
    loads the compiled kernels instead of compiling them again (torch's default lives under /tmp)."""
    from eyas.io import cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
