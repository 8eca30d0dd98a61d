"""The export stage: what ``eyas export`` and ``eyas run`` both do — export RUN_DIR, check it, say so."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from eyas.errors import EyasError
from eyas.export.options import ExportOptions


def export_stage(options: ExportOptions, console: Console) -> Path:
    """Export RUN_DIR/final as DRAFT_DIR, run ``eyas check`` on it and print the verdict and any problems."""
    from eyas.export.check import check_draft_dir

    path = export_run(options.run_dir, options.out, options.dtype, options.format)
    result = check_draft_dir(path)
    console.print(f"wrote {path}; eyas check: {'ok' if result.ok else 'FAILED'}", soft_wrap=True)
    for problem in result.errors + result.warnings:
        console.print(f"  {problem}", soft_wrap=True, highlight=False)
    return path


def export_run(run_dir: Path, out: Path, dtype: str = "bf16", fmt: str = "eagle3") -> Path:
    """Export RUN_DIR/final (what ``eyas train`` wrote) as an EAGLE-3 drafter directory (or speculators format)."""
    from safetensors.torch import load_file

    from eyas.drafter.config import DrafterConfig
    from eyas.export.card import model_card, serve_target
    from eyas.export.eagle3 import TORCH_DTYPES, draft_config, draft_tensors
    from eyas.export.files import DRAFT_FILES, write_draft_dir
    from eyas.export.speculators import speculators_config
    from eyas.manifest import input_record, write_manifest
    from eyas.target.facts import target_input
    from eyas.train.resume import read_run_record, run_options

    run_dir = Path(run_dir)
    final = run_dir / "final"
    if not (final / "model.safetensors").is_file():
        raise EyasError(f"{run_dir} has no final/model.safetensors: train it first (eyas train ... --out {run_dir})")
    if dtype not in TORCH_DTYPES:
        raise EyasError(f"--dtype must be bf16, fp16 or fp32, not {dtype!r}")
    if fmt not in ("eagle3", "speculators"):
        raise EyasError(f"--format must be eagle3 or speculators, not {fmt!r}")
    drafter = DrafterConfig.from_dict(json.loads((final / "drafter_config.json").read_text()))
    recorded = read_run_record(run_dir)
    if recorded is None:
        raise EyasError(f"{run_dir}/train_options.json is missing: RUN_DIR is incomplete; train it again into a new --out")
    options = run_options(recorded)
    target = _target_facts(run_dir, options)
    config = draft_config(drafter, target["model_type"], target["num_layers"], dtype)
    tensors = draft_tensors(load_file(str(final / "model.safetensors")), config, dtype)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
    card = model_card(config, options, report, target, Path(out))
    if fmt == "speculators":  # the verifier as vLLM loads it (a placeholder would not load: then the spec, as recorded)
        engine_target, _ = serve_target(target)
        config = speculators_config(config, options["target"] if engine_target.startswith("<") else engine_target)
    stage = ExportOptions(run_dir=run_dir, out=Path(out), format=fmt, dtype=dtype)
    inputs = [input_record("run", run_dir), target_input(target)]
    return write_draft_dir(out, config, tensors, card,
                           then=lambda tmp: write_manifest(tmp, "export", stage, inputs, DRAFT_FILES, target=target))


def _target_facts(run_dir: Path, train_options: dict) -> dict:
    """What export needs of the target, from RUN_DIR (target.json); a run made before runs recorded it loads the
    target's config instead (a hub id may then download it)."""
    from eyas.train.run_dir import read_target_facts

    facts = read_target_facts(run_dir)
    if facts is not None:
        return facts
    from eyas.target.facts import target_facts
    from eyas.target.loading import load_target_config

    config, source = load_target_config(train_options["target"], bool(train_options.get("trust_remote_code")))
    return target_facts(train_options["target"], config, source)
