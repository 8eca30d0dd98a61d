"""Stopping a training run early on request, after the current step and with a checkpoint (SIGTERM, a first Ctrl-C)."""

from __future__ import annotations

import signal
import sys
import threading

import torch

from eyas.distributed import all_reduce_sum, world_size


class StopRequests:
    """SIGTERM (a scheduler's time limit, ``timeout``, torchrun shutting down) or a first Ctrl-C ends
    training after the current step, with a checkpoint, instead of losing every step since the last
    one; the same command with ``--resume`` continues. A second Ctrl-C interrupts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self.exit_code = 0  # 128 + the signal's number, the shell's convention for a run a signal ended
        self._previous: dict = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._request)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _request(self, number, frame) -> None:
        if self.signal_name is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name, self.exit_code = signal.Signals(number).name, 128 + number
        print(f"\neyas train: {self.signal_name}; stopping after this step with a checkpoint (Ctrl-C again to "
              "interrupt now)", file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True when this rank or any other was asked to stop (ranks may see the signal a step apart)."""
        requested = torch.tensor([1.0 if self.signal_name else 0.0])
        if world_size() > 1:
            all_reduce_sum(requested)
            if self.signal_name is None and requested.item() > 0:
                self.signal_name, self.exit_code = "a stop on another rank", 128 + signal.SIGTERM
        return bool(requested.item() > 0)
