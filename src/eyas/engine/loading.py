"""A target and a drafter directory loaded behind the engine's runners: what ``eyas bench`` and ``eyas generate`` decode
with, and the dtype they decode in (:func:`decoding_dtype`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.engine.modes import Speculation
from eyas.engine.target_runner import TargetRunner

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # --dtype's names; "auto" is decoding_dtype's choice


def cpu_capabilities(cpuinfo: Path = Path("/proc/cpuinfo")) -> Mapping[str, object]:
    """This CPU's instruction sets as torch reads them (``torch.cpu.get_capabilities``, where torch has it), else the
    flags of Linux's ``cpuinfo``, else nothing known."""
    read = getattr(torch.cpu, "get_capabilities", None)
    if read is not None:
        return read()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    flags = next((line.partition(":")[2].split() for line in text.splitlines() if line.startswith("flags")), [])
    return dict.fromkeys(flags, True)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX-512 BF16 or AMX). There a target forward of a few
    tokens costs what one costs in bf16 (the demo target on a 2-core EPYC: 24–28 ms for 2–8 tokens, 26 ms for one),
    where in fp32 it costs 1.5× (63–65 ms against 41): what speculation needs."""
    capabilities = cpu_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def decoding_dtype(device: torch.device | str | None = None, choice: str = "auto") -> torch.dtype:
    """The dtype eyas' engine decodes in (``--dtype``): bf16 or fp32 as asked; ``auto`` = bf16 on CUDA and on a CPU
    with native bf16 matrix multiplies (:func:`cpu_has_native_bf16`), else fp32. Capture and training keep
    :func:`eyas.target.loading.default_dtype` (fp32 on every CPU). Greedy speculation equals plain decoding token for
    token only in fp32: in bf16 a near-tie may round one way in a one-token forward and the other in a k-token one."""
    from eyas.target.loading import default_device

    if choice != "auto":
        return DTYPES[choice]
    kind = torch.device(device).type if device is not None else default_device().type
    return torch.bfloat16 if kind == "cuda" or (kind == "cpu" and cpu_has_native_bf16()) else torch.float32


@dataclass
class Engine:
    """A loaded target and (maybe) drafter behind their runners, plus the ids that end a turn."""

    target: object  # eyas.target.loading.Target
    target_runner: TargetRunner
    draft_runner: object | None  # the drafter family's runner (Family.runner), or None: plain decoding
    stop_ids: set[int] = field(default_factory=set)


def load_engine(target_spec: str, draft_dir: Path | None, capacity: int, device: str | None = None,
                trust_remote_code: bool = False, dtype: torch.dtype | str = "auto", target=None,
                graphs: bool = True, compile: bool = False, lean: bool = True,
                modes: Sequence[Speculation] = ()) -> Engine:
    """Target (in ``dtype``: a torch dtype or a --dtype name, :func:`decoding_dtype`) and, with ``draft_dir``, its
    drafter (same device and dtype); ``target`` reuses an already loaded target, in its dtype. ``graphs``: on CUDA,
    decoding steps replay CUDA graphs; ``compile``: the target's steps are fused by torch.compile before recording;
    ``lean``: Llama-family targets decode through :mod:`eyas.engine.fused_llama`. The drafter runs behind its family's
    runner (:meth:`eyas.families.Family.runner`), which sizes its cache for the ``modes`` it will decode
    (:func:`eyas.engine.modes.drafter_spare`) and refuses one it cannot."""
    from eyas import families
    from eyas.target.loading import load_target, stop_ids

    if target is None:
        dtype = dtype if isinstance(dtype, torch.dtype) else decoding_dtype(device, dtype or "auto")
        target = load_target(target_spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    draft_runner = None if draft_dir is None else \
        families.of_draft_dir(draft_dir).runner(Path(draft_dir), target.layout, capacity, list(modes))
    runner = TargetRunner(target.model, target.layout, draft_runner.layer_ids if draft_runner else None, capacity,
                          graphs=graphs, compile=compile, lean=lean)
    return Engine(target, runner, draft_runner, set(stop_ids(target.model, target.tokenizer)))


def load_target_for(draft_dir: Path | None, target_spec: str, device: str | None = None, trust_remote_code: bool = False,
                    dtype: str = "auto"):
    """The target to decode with ``draft_dir``, in the ``dtype`` --dtype names (:func:`decoding_dtype`), loaded only
    once the drafter is known to fit it (:mod:`eyas.export.fit`: a drafter made for another target fails in one line,
    before any weight is read)."""
    from eyas.export.fit import require_fit
    from eyas.target.loading import load_target

    require_fit(draft_dir, target_spec, trust_remote_code)
    return load_target(target_spec, device=device, dtype=decoding_dtype(device, dtype), trust_remote_code=trust_remote_code)


def prompt_tensor(ids: list[int]) -> torch.Tensor:
    """Token ids as the [1, P] tensor the engine takes."""
    return torch.tensor([ids], dtype=torch.long)
