"""Capture the target's hidden states for EAGLE-3 in one prefill forward, or fail loudly.

Per token we need the aux states at the eyas layer ids (the residual stream entering those
decoder layers), concatenated low→mid→high into ``[T, k·H]``, and the final hidden — the
tensor lm_head consumes, i.e. the final norm's output. Forward hooks get them without patching
model code; the price of hooks is that they can be skipped (torch.compile, CUDA-graph replay,
a layer swapped after discovery) or fire twice, so every tap counts its calls and checks its
token count, and any surprise raises a CaptureError naming the cause and the fix. Nothing
partial is ever returned.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eyas.errors import CaptureError
from eyas.target.layout import TargetLayout
from eyas.target.taps import TapRecord, Taps, hidden_argument

_BYPASS_FIX = (
    "capture needs a forward in which every decoder layer module runs as a module: pass the "
    "uncompiled model (for torch.compile'd models, `model._orig_mod`; a layer's own `forward` may be "
    "compiled, as fused_decoder_layers does), do not replay CUDA graphs during capture, and call "
    "discover_layout() again after replacing any layer"
)


@dataclass
class CapturedStates:
    """Hidden states of one batch: ``aux`` [B, T, k·H] (low→high), ``final`` [B, T, H]."""

    aux: torch.Tensor
    final: torch.Tensor
    layer_ids: tuple[int, ...]
    lengths: torch.Tensor  # [B] real (unpadded) tokens per row; padding is on the right

    def sequence(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row`` without its padding: (aux [T_i, k·H], final [T_i, H])."""
        n = int(self.lengths[row])
        return self.aux[row, :n], self.final[row, :n]


class _Buffers:
    """Assembles the captured states in place, then moves them off the accelerator in one go.

    Each aux tap copies its tensor straight into its slice of one ``[B, T, k·H]`` buffer on the
    model's device (a device-side copy, queued behind the layer that produced it), so no
    concatenation is needed afterwards — on the host that would cost a full extra pass over
    the bytes. With ``offload`` the finished buffers go to pinned host memory with
    non-blocking copies on a side stream, overlapping whatever the model still runs (lm_head).
    Copies, not references: a model updating its residual in place cannot alter them.
    """

    def __init__(self, batch: int, tokens: int, width: int, taps: Taps):
        self.shape = (batch, tokens, width * len(taps))
        self.width, self.taps = width, taps
        self.aux: torch.Tensor | None = None
        self.final: torch.Tensor | None = None
        self._host: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None

    def aux_slot(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A store function writing a tap's tensor into aux[..., index·H:(index+1)·H]."""

        def store(tensor: torch.Tensor) -> torch.Tensor:
            if self.aux is None:
                self.aux = torch.empty(self.shape, dtype=tensor.dtype, device=tensor.device)
            slot = self.taps.view(self.aux, index)
            slot.copy_(tensor.detach())  # crosses GPUs when the target spans several
            return slot

        return store

    def store_final(self, tensor: torch.Tensor) -> torch.Tensor:
        self.final = tensor.detach().clone()
        return self.final

    def start_offload(self) -> None:
        """Queue non-blocking copies of aux and final into pinned host memory (CUDA only)."""
        if self.aux is None or self.aux.device.type != "cuda":
            return
        device = self.aux.device
        self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for tensor in (self.aux, self.final):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)  # keep device memory alive until copied
                self._host.append(host)

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux, final), on the host if offloaded; waits for the copies."""
        if self._stream is None:
            return self.aux, self.final
        self._stream.synchronize()
        return self._host[0], self._host[1]


def capture_hidden_states(
    model: nn.Module,
    layout: TargetLayout,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer_ids: Sequence[int] | None = None,
    offload: bool = True,
    compile_layers: bool = False,
    **model_inputs,
) -> CapturedStates:
    """Run one prefill forward and return the aux states at ``layer_ids`` and the final hidden.

    ``input_ids`` [B, T] (right-padded, ``attention_mask`` 1 on real tokens); extra
    ``model_inputs`` (``pixel_values`` …) go to the model unchanged. With ``offload`` the
    states are copied to pinned host memory as they are produced; otherwise they stay on the
    model's device; with ``compile_layers``, on CUDA, the decoder layers run compiled (:func:`fused_decoder_layers`).
    Raises CaptureError rather than returning anything partial.

    The mask is checked (right padding only) but not given to the model: a causal target keeps every real token from
    the padding after it, so the real tokens' states are those of each sequence alone either way (pinned for every
    test architecture), and without a mask the attention runs as plain causal attention (on CUDA, a flash kernel that
    skips the masked half) instead of a kernel that reads a [B, T, T] mask.
    """
    taps = Taps(layer_ids, layout.num_layers)
    _refuse_bypassing_setups(model, layout)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = attention_mask.unsqueeze(0) if attention_mask is not None else None
    lengths = _right_padded_lengths(input_ids, attention_mask)
    batch, tokens = input_ids.shape
    expect = (batch, tokens, layout.hidden_size)
    buffers = _Buffers(batch, tokens, layout.hidden_size, taps)
    final_tap = TapRecord(f"{layout.norm_path} output (final hidden)", buffers.store_final)
    # lm_head may see fewer tokens (logits_to_keep); keep what it consumed to cross-check.
    head_tap = TapRecord(f"{layout.lm_head_path} input", lambda t: t.detach().clone())
    final_tap.arm(expect)
    head_tap.arm((batch,))

    hooks = taps.hooks(layout, [buffers.aux_slot(k) for k in range(len(taps))])
    handles = []
    try:
        handles.append(layout.norm.register_forward_hook(lambda m, a, out: _final_hook(final_tap, buffers, offload, out)))
        handles.append(layout.lm_head.register_forward_pre_hook(
            lambda m, args, kwargs: head_tap.record(hidden_argument(head_tap.what, args, kwargs)), with_kwargs=True))
        hooks.arm(expect)
        # compiled on CUDA only: a CPU capture would wait a minute for inductor's C++ to save little
        with fused_decoder_layers(layout, compile_layers and _first_param_device(layout.embed).type == "cuda"):
            _forward(model, layout, input_ids, model_inputs)
    finally:
        problems = hooks.disarm()
        hooks.remove()
        for handle in handles:
            handle.remove()

    problems += [p for p in (final_tap.problem(),) if p]
    if problems:
        raise CaptureError(_explain(problems))
    _check_lm_head_consumed_final(head_tap, final_tap.tensor)
    aux, final = buffers.results()
    return CapturedStates(aux=aux, final=final, layer_ids=taps.layer_ids, lengths=lengths)


def _final_hook(tap: TapRecord, buffers: _Buffers, offload: bool, out) -> None:
    tap.record(out if isinstance(out, torch.Tensor) else out[0])
    if offload and tap.calls == 1 and tap.tensor is not None:
        buffers.start_offload()  # every aux layer has run: start the copies while lm_head runs


def _forward(model, layout, input_ids, model_inputs) -> None:
    device = _first_param_device(layout.embed)
    kwargs = {"input_ids": input_ids.to(device), **model_inputs}
    params = inspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "use_cache" in params or takes_kwargs:
        kwargs["use_cache"] = False
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1  # we need hidden states, not [T, V] logits
    was_training = model.training
    if was_training:
        model.eval()  # dropout would make the captured states random
    try:
        with torch.no_grad():  # not inference_mode: trainers feed these states to autograd
            model(**kwargs)
    finally:
        if was_training:  # toggling walks every module: only when needed (it costs ms)
            model.train()


def _first_param_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def _right_padded_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    batch, tokens = input_ids.shape
    if attention_mask is None:
        return torch.full((batch,), tokens, dtype=torch.long)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {list(attention_mask.shape)} differs from input_ids {list(input_ids.shape)}")
    mask = attention_mask.to("cpu", torch.long)
    lengths = mask.sum(dim=1)
    expected = (torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)).long()
    if not torch.equal(mask, expected):
        raise ValueError(
            "capture takes right-padded batches (tokens first, padding after): left padding or "
            "holes shift positions and change the states; pad with tokenizer.padding_side='right'"
        )
    return lengths


@contextlib.contextmanager
def fused_decoder_layers(layout: TargetLayout, wanted: bool = True):
    """Within the block (with ``wanted``), each decoder layer's ``forward`` runs compiled
    (:func:`eyas.compiling.compiled`, dynamic shapes: one graph for every batch's width): inductor fuses its norms,
    rotary embedding, activation and residual adds — most of a prefill's kernels and memory traffic for a target as
    narrow as the demo's. Only ``forward``: ``nn.Module.__call__`` runs a layer's hooks around it, eagerly, so
    capture's taps still fire once per forward on the tensor the layer was called with, and a swapped or replayed layer
    is still caught. The layers are as they were after the block (a layer whose ``forward`` someone replaced already is
    left alone); torch.compile's cache is per code, so a later block compiles nothing again. A compilation that fails
    (an architecture inductor cannot take) is a CaptureError naming ``--no-compile-layers``."""
    fused = []
    if wanted:
        for layer in layout.layers:
            if "forward" not in vars(layer):
                layer.forward = functools.partial(_compiled_forward(type(layer)), layer)
                fused.append(layer)
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as err:
        if not fused:
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise CaptureError(f"compiling the target's decoder layers for the capture failed ({type(err).__name__}: "
                           f"{first}): rerun with --no-compile-layers, which captures with the HF forward as it is") from err
    finally:
        for layer in fused:
            del layer.forward


@functools.cache
def _compiled_forward(layer_class: type) -> Callable:
    """A decoder layer class's ``forward`` (unbound) compiled once, for all its layers: making a torch.compile wrapper
    costs milliseconds, a layer's call through the cached one none."""
    from eyas.compiling import compiled

    return compiled(layer_class.forward, dynamic=True)


def _refuse_bypassing_setups(model: nn.Module, layout: TargetLayout) -> None:
    """Catch, before running, the setups in which hooks silently do not run: a tapped module's hooks inside a compiled
    region. A compiled region that holds no tapped module's call (a decoder layer's compiled ``forward``: its own hooks
    run around it) is no bypass."""
    def compiled(module: nn.Module, forward_too: bool) -> bool:
        return (isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
                or getattr(module, "_compiled_call_impl", None) is not None  # nn.Module.compile(): its hooks inside
                or (forward_too and hasattr(module.forward, "_torchdynamo_orig_callable")))

    # every layer and the final norm, whose hooks capture may use: their own forward compiled is no bypass
    hooked = [(f"{layout.layers_path}.{i}", layer) for i, layer in enumerate(layout.layers)] + [(layout.norm_path, layout.norm)]
    for what, module, forward_too in (*((what, module, True) for what, module in _ancestors(model, layout)),
                                      *((what, module, False) for what, module in hooked)):
        if compiled(module, forward_too):
            raise CaptureError(
                f"{what} is compiled with torch.compile: compiled graphs may run without calling "
                f"the module hooks capture relies on, so the states could be missing or stale. {_BYPASS_FIX}"
            )
    if torch.compiler.is_compiling():
        raise CaptureError(f"capture was called inside a torch.compile trace. {_BYPASS_FIX}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise CaptureError(
            "capture was called while a CUDA graph is being captured: on replay no hook runs and "
            f"nothing would be recorded. {_BYPASS_FIX}"
        )


def _ancestors(model: nn.Module, layout: TargetLayout) -> list[tuple[str, nn.Module]]:
    """The model and every module on the paths down to the decoder stack and the final norm (named for messages): a
    compiled forward of any of them runs the tapped modules' calls inside its graph."""
    found = {"the model": model}
    for path in (layout.layers_path, layout.norm_path):
        parts = path.split(".")
        for depth in range(1, len(parts)):
            name = ".".join(parts[:depth])
            found.setdefault(name, model.get_submodule(name))
    found.setdefault("the decoder stack", layout.layers)
    return list(found.items())


def _explain(problems: list[str]) -> str:
    text = "hidden-state capture failed, nothing was returned:\n  - " + "\n  - ".join(problems)
    if any("did not fire" in p for p in problems):
        text += (
            "\nA hook that does not fire means the module did not run as a Python module: the model "
            "was compiled or is replaying a CUDA graph, or a layer was swapped out after the layout "
            f"was discovered. {_BYPASS_FIX}."
        )
    if any("times in one forward" in p for p in problems):
        text += (
            "\nA hook that fires twice means the module ran twice in one forward (a wrapper calling "
            "the language model twice, or a layer object shared at two depths); capture one "
            "forward of a model whose decoder layers each run once."
        )
    if any("saw a tensor of shape" in p for p in problems):
        text += (
            "\nA token count different from input_ids means the model inserts or drops tokens inside "
            "its forward (e.g. expanding image placeholders) or shards the sequence; give capture "
            "input_ids that already hold every position the decoder sees."
        )
    return text


def _check_lm_head_consumed_final(head_tap: TapRecord, final: torch.Tensor) -> None:
    """The final hidden must be what lm_head consumes; check it on the positions it saw."""
    if head_tap.calls != 1 or head_tap.tensor is None:
        return  # a model may skip lm_head when asked for no logits; the norm tap still counted
    seen = head_tap.tensor
    tail = final[:, final.shape[1] - seen.shape[1] :]
    if seen.shape != tail.shape or not torch.equal(seen.to(tail.dtype), tail):
        raise CaptureError(
            "the tensor lm_head consumed differs from the final norm's output: this model transforms "
            "the hidden state between its final norm and lm_head (e.g. a MiniCPM-style scale), so the final norm is not "
            "the last step before the head; report the architecture to eyas"
        )
