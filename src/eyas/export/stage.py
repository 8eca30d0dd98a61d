"""The export stage's options: what ``eyas export`` and ``eyas run`` pass to :func:`export_run`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ExportOptions:
    """Everything ``eyas export`` takes; defaults are the documented ones."""

    run_dir: Path
    out: Path
    format: str = "eagle3"  # or "speculators" (vLLM's own format)
    dtype: str = "bf16"  # or "fp16" ("fp32" for tests)
