"""Replay fixed-shape steps from CUDA graphs.

A small target on a big GPU is launch-bound: an eager decode step of the 30-layer demo target
launches ~1,000 kernels from Python and takes tens of milliseconds, while the GPU work itself is well
under one. A CUDA graph records one step's kernels once and replays them with one launch.
What it needs from the step: every input read from, and every output written to, the same memory
each time (the runners keep per-shape input buffers), and no host synchronisation inside.

A step is a function of no arguments that reads its inputs from its own buffers. ``run(key, step)``
records it on the first call of each key (after warm-up runs on a side stream, as CUDA requires)
and replays it afterwards; the returned outputs are the graph's own tensors, overwritten by the
next replay of that key. Each graph has its own memory pool: graphs sharing a pool must replay in
the order they were recorded (a later graph's outputs live where an earlier one keeps its scratch),
and decoding replays them in whatever order the accepted lengths dictate — a tree's first drafter
step, recorded late, had its proposals overwritten by the next steps' scratch. The pools are small
(one step's activations). Off CUDA, or with graphs disabled, the step simply runs — the same code,
which is what the CPU tests exercise.

``compile``: each step is first compiled by ``torch.compile`` (inductor fuses the norms, rotary
embeddings and activations that make up most of the launches), keeping eager's bf16 rounding between the
fused ops (:func:`compiled`), then recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from eyas import compiling
from eyas.errors import CaptureError

log = logging.getLogger(__name__)

Step = Callable[[], Any]


class StepGraphs:
    """Per-key CUDA graphs of fixed-shape steps (plain calls off CUDA or when ``enabled`` is False)."""

    def __init__(self, device: torch.device, enabled: bool = True, compile: bool = False, warmups: int = 2,
                 name: str = "a decoding step", raises: tuple[type[BaseException], ...] = ()):
        """``raises``: errors of a recording that propagate (the caller handles them, e.g. out of memory by
        smaller batches) instead of turning graphs off."""
        self.enabled = enabled and device.type == "cuda"
        self.raises = raises
        self.compile = compile and self.enabled
        self.warmups = warmups
        self.device, self.name = device, name
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def has(self, key: Hashable) -> bool:
        """Whether a graph is recorded for ``key``."""
        return key in self._graphs

    def drop(self, which: Callable[[Hashable], bool]) -> None:
        """Forget the recordings whose key ``which`` selects (the buffers they read are about to be freed)."""
        for key in [key for key in self._graphs if which(key)]:
            del self._graphs[key]

    def replay(self, key: Hashable) -> Any:
        """Replay the graph recorded for ``key`` (which must exist) → its outputs; for measuring a recording alone."""
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def run(self, key: Hashable, step: Step) -> Any:
        """Replay the graph recorded for ``key``, recording ``step`` first if there is none. The warm-up
        runs really execute: a step may write scratch memory (cache slots past the committed ones)
        but must not change what it reads (else see :meth:`ensure`)."""
        if not self.enabled or (key not in self._graphs and not self._try_record(key, step)):
            return step()
        return self.replay(key)

    def ensure(self, key: Hashable, step: Step) -> bool:
        """Record ``step`` for ``key`` unless it already is; True when a recording was just attempted —
        its warm-up runs executed, so a step that updates its own inputs (a decoding burst) must
        refill them."""
        if not self.enabled or key in self._graphs:
            return False
        self._try_record(key, step)
        return True

    def _try_record(self, key: Hashable, step: Step) -> bool:
        """Record; a step that cannot be recorded (a host synchronisation inside, data-dependent
        control flow, a compiler error) turns graphs off for good, with a warning, and runs eagerly."""
        try:
            self._graphs[key] = self._record(step)
            return True
        except CaptureError:
            raise  # the aux taps misfired: a real error, not a reason to go eager
        except self.raises:
            raise
        except Exception as error:  # anything a recording can raise
            log.warning("eyas: %s cannot be replayed from a CUDA graph (%s: %s); running eagerly",
                        self.name, type(error).__name__, error)
            self.enabled, self.compile = False, False
            self._graphs.clear()
            return False

    def _record(self, step: Step):
        fn = compiled(step) if self.compile else step
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmups):  # lazy initialisation, compilation, cuBLAS workspaces
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a private pool: see the module's note
            outputs = fn()
        return graph, outputs


def compiled(step: Step) -> Step:
    """``step`` under torch.compile as the engine compiles its rounds: fixed shapes, and eager's rounding kept
    (:mod:`eyas.compiling`): a compiled round's drafter once scored its tree differently from the eager round's on the
    same inputs (the RMSNorms, SiLU·up, the residual adds, unrounded between fused ops), so compiled and eager decoders
    chose other drafts and forked into other answers. With eager's rounding kept, the compiled round is the eager
    round's arithmetic (benchmarks/round_agreement.py compares them round by round)."""
    return compiling.compiled(step, dynamic=False)


class InputBuffer:
    """A step's input on the device, refilled from the host without stalling it.

    A plain host-to-GPU ``copy_`` from pageable memory waits for the GPU to finish everything queued
    before it, so the host could never run ahead of the kernels, and pinning a fresh tensor for every
    copy costs more than the step. Each buffer keeps its own pinned staging tensor; an event says when
    the last copy out of it has run, so it is never overwritten while the GPU still reads it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self._staging = torch.empty(shape, dtype=dtype, pin_memory=True) if device.type == "cuda" else None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(self, source: torch.Tensor) -> torch.Tensor:
        if self._staging is None or source.device.type != "cpu":
            self.tensor.copy_(source)  # same device: queued like any kernel
            return self.tensor
        self._copied.synchronize()  # at once unless the previous copy is still queued
        self._staging.copy_(source)
        self.tensor.copy_(self._staging, non_blocking=True)
        self._copied.record()
        return self.tensor
