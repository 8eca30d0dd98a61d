"""The tap convention, written once: which tensor each eyas layer id names, and where it sits in aux.

Layer id ``L`` (0 ≤ L < N) is the residual stream entering decoder layer ``L`` — the hidden-states
argument of that layer's forward, HF ``output_hidden_states[L]``; id ``N`` is the last layer's output
before the final norm — the final norm's input (DESIGN "Conventions"). A tap set lists its ids low →
high, and tap ``i`` holds columns ``[i·H, (i+1)·H)`` of the aux tensor ``[..., k·H]`` the drafter's fc
reads. Every reader and writer of aux states goes through :class:`Taps`: capture's hooks, the engine's
target forward (the HF forward's hooks, the fused Llama forward's direct writes) and the split of the
states vLLM returns per layer id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from eyas.errors import CaptureError
from eyas.target.layer_ids import resolve_layer_ids
from eyas.target.layout import TargetLayout

Store = Callable[[torch.Tensor], torch.Tensor | None]


class Taps:
    """The aux taps of an ``num_layers``-layer target at ``layer_ids`` (default 2, N//2, N-3), low → high."""

    def __init__(self, layer_ids: Sequence[int] | None, num_layers: int):
        self.num_layers = num_layers
        self.layer_ids = resolve_layer_ids(layer_ids, num_layers)

    def __len__(self) -> int:
        return len(self.layer_ids)

    def columns(self, index: int, width: int) -> slice:
        """Where tap ``index`` sits along aux's last dimension, for states ``width`` wide."""
        return slice(index * width, (index + 1) * width)

    def view(self, aux: torch.Tensor, index: int) -> torch.Tensor:
        """Tap ``index``'s part of ``aux`` [..., k·H] (a view: writing it writes aux)."""
        return aux[..., self.columns(index, aux.shape[-1] // len(self))]

    def entering(self, layer: int) -> int | None:
        """The tap that holds the residual stream entering decoder layer ``layer`` (``N``: the final norm's
        input), or None when that tensor is not tapped."""
        return self.layer_ids.index(layer) if layer in self.layer_ids else None

    def assemble(self, states: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """States [T, m, H] at layer ids ``ids`` (every tap among them, in any order) → aux [T, k·H]."""
        missing = [i for i in self.layer_ids if i not in ids]
        if missing:
            raise ValueError(f"states at layer ids {list(ids)} lack the taps {missing}")
        picked = states[:, [list(ids).index(i) for i in self.layer_ids]]
        return picked.reshape(states.shape[0], len(self) * states.shape[-1])

    def module(self, layout: TargetLayout, index: int) -> nn.Module:
        """The module whose input tap ``index`` is: decoder layer L, or the final norm for id N."""
        layer_id = self.layer_ids[index]
        return layout.layers[layer_id] if layer_id < layout.num_layers else layout.norm

    def describe(self, layout: TargetLayout, index: int) -> str:
        """``model.layers.2 input (layer id 2)``: what tap ``index`` reads, for messages."""
        layer_id = self.layer_ids[index]
        where = f"{layout.layers_path}.{layer_id}" if layer_id < layout.num_layers else layout.norm_path
        return f"{where} input (layer id {layer_id})"

    def hooks(self, layout: TargetLayout, stores: Sequence[Store]) -> TapHooks:
        """Forward pre-hooks on every tap's module, tap ``i`` handing its tensor to ``stores[i]``."""
        return TapHooks(self, layout, stores)


class TapRecord:
    """One hook's record over a forward: how often it fired and what it saw the first time.

    ``expect`` holds the leading dims the tensor must have (batch, tokens, hidden); the first tensor is
    handed to ``store`` when it has them. A hook that did not fire, fired twice, or saw another shape is
    a :meth:`problem`: the module did not run as the Python module the layout names, once."""

    def __init__(self, what: str, store: Store):
        self.what, self.store = what, store
        self.arm(())

    def arm(self, expect: tuple[int, ...]) -> None:
        """Forget the last forward; the next tensor must start with the dims ``expect``."""
        self.expect, self.calls, self.shape, self.tensor = expect, 0, None, None

    def record(self, tensor: torch.Tensor) -> None:
        """Count a call; keep (store) the first tensor when its shape is the expected one."""
        self.calls += 1
        if self.calls == 1:
            self.shape = tuple(tensor.shape)
            if self.shape[: len(self.expect)] == self.expect:
                self.tensor = self.store(tensor)

    def problem(self) -> str | None:
        """Why this forward's record cannot be used, or None."""
        if self.calls == 0:
            return f"the hook on {self.what} did not fire"
        if self.calls > 1:
            return f"the hook on {self.what} fired {self.calls} times in one forward (expected once)"
        if self.shape[: len(self.expect)] != self.expect:
            return f"{self.what} saw a tensor of shape {list(self.shape)}, expected {list(self.expect)} (batch, tokens, hidden)"
        return None


def hidden_argument(what: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden-states tensor a decoder layer or norm was called with (first positional argument, or by name)."""
    tensor = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
    if not isinstance(tensor, torch.Tensor):
        raise CaptureError(f"cannot find the hidden-states tensor among the arguments of {what}")
    return tensor


class TapHooks:
    """Pre-hooks on each tap's module, each feeding its :class:`TapRecord`; they record only while armed
    (between :meth:`arm` and :meth:`disarm`), so the model stays usable for anything else."""

    def __init__(self, taps: Taps, layout: TargetLayout, stores: Sequence[Store]):
        self.records = [TapRecord(taps.describe(layout, i), store) for i, store in enumerate(stores)]
        self.armed = False
        self._handles = [taps.module(layout, i).register_forward_pre_hook(self._hook(record), with_kwargs=True)
                         for i, record in enumerate(self.records)]

    def _hook(self, record: TapRecord):
        def hook(module, args, kwargs):
            if self.armed:
                record.record(hidden_argument(record.what, args, kwargs))
        return hook

    def arm(self, expect: tuple[int, ...]) -> None:
        """Record the next forward, whose tapped tensors must start with the dims ``expect``."""
        for record in self.records:
            record.arm(expect)
        self.armed = True

    def disarm(self) -> list[str]:
        """Stop recording → the problems of the forward just run (empty when every tap fired once, as expected)."""
        self.armed = False
        problems = [record.problem() for record in self.records]
        return [problem for problem in problems if problem is not None]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
