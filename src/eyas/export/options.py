"""The options of ``eyas export``: each field's default and help, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas import families
from eyas.options import Options, force_option, option


@dataclass
class ExportOptions(Options):
    """Export a trained drafter in a format its engines load, then check it."""

    run_dir: Path = option(help="RUN_DIR written by eyas train", positional=True)
    out: Path = option(help="DRAFT_DIR to write (config.json, model.safetensors, README.md)")
    format: str = option("auto", "auto = the first format of the run's drafter family; or " + "; ".join(
        f"{name} = {what}" for name, what in families.export_formats().items()))
    dtype: str = option("bf16", "bf16 or fp16 (fp32 for tests)")
    force: bool = force_option()
