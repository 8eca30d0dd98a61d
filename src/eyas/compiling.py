"""How eyas calls ``torch.compile``, once: eager's bf16 rounding kept between fused ops, and the compiled kernels kept
in the eyas cache.

In bf16 every eager op rounds its output to bf16; inductor, fusing ops into one kernel, keeps what is between them in
fp32 unless told to round there too (``emulate_precision_casts``). The unrounded kernels are no more wrong, but they
are different, and eyas compiles only where the result must be the eager forward's arithmetic: the engine's decoding
rounds (:func:`eyas.engine.graphs.compiled`) and capture's decoder layers (:func:`eyas.target.capture.fused_decoder_layers`).
"""

from __future__ import annotations

import os
from collections.abc import Callable


def compiled(fn: Callable, dynamic: bool) -> Callable:
    """``fn`` under torch.compile with eager's rounding kept; ``dynamic``: one graph for every input shape (inductor's
    kernels take the sizes as arguments) rather than one per shape."""
    import torch

    use_persistent_compile_cache()
    return torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True})


def use_persistent_compile_cache() -> None:
    """Keep torch.compile's caches (FX graphs, Triton kernels) in the eyas cache, ``$EYAS_CACHE/inductor``, unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: a later process that compiles the same code on the same GPU and torch
    loads the compiled kernels instead of compiling them again (torch's default lives under /tmp)."""
    from eyas.io import cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
