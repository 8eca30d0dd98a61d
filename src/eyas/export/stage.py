"""The export stage: what ``eyas export`` and ``eyas run`` both do — export RUN_DIR, check it, say so."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console


@dataclass
class ExportOptions:
    """Everything ``eyas export`` takes; defaults are the documented ones."""

    run_dir: Path
    out: Path
    format: str = "eagle3"  # or "speculators" (vLLM's own format)
    dtype: str = "bf16"  # or "fp16" ("fp32" for tests)


def export_stage(options: ExportOptions, console: Console) -> Path:
    """Export RUN_DIR/final as DRAFT_DIR, run ``eyas check`` on it and print the verdict and any problems."""
    from eyas.export.check import check_draft_dir
    from eyas.export.eagle3 import export_run

    path = export_run(options.run_dir, options.out, options.dtype, options.format)
    result = check_draft_dir(path)
    console.print(f"wrote {path}; eyas check: {'ok' if result.ok else 'FAILED'}", soft_wrap=True)
    for problem in result.errors + result.warnings:
        console.print(f"  {problem}", soft_wrap=True, highlight=False)
    return path
