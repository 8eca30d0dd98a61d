"""The options of ``eyas export``: each field's default and help, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.options import Options, force_option, option


@dataclass
class ExportOptions(Options):
    """Export a trained drafter — EAGLE-3 in the format SGLang and vLLM both load, DFlash in vLLM's — then check it."""

    run_dir: Path = option(help="RUN_DIR written by eyas train", positional=True)
    out: Path = option(help="DRAFT_DIR to write (config.json, model.safetensors, README.md)")
    format: str = option("auto", "auto = the run's family (eagle3 for an EAGLE-3 run, dflash for a DFlash one); eagle3 "
                         "(SGLang and vLLM), speculators (vLLM's own EAGLE-3 format) or dflash (vLLM's dflash method)")
    dtype: str = option("bf16", "bf16 or fp16 (fp32 for tests)")
    force: bool = force_option()
