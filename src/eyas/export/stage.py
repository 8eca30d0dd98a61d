"""The export stage: what ``eyas export`` and ``eyas run`` both do — export RUN_DIR, check it, say so."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from eyas.errors import EyasError
from eyas.export.options import ExportOptions
from eyas.out_lock import one_writer


def export_stage(options: ExportOptions, console: Console) -> Path:
    """Export RUN_DIR/final as DRAFT_DIR, run ``eyas check`` on it and print the verdict and any problems."""
    from eyas.export.check import check_draft_dir

    path = export_run(options.run_dir, options.out, options.dtype, options.format, options.force)
    result = check_draft_dir(path)
    console.print(f"wrote {path}; eyas check: {'ok' if result.ok else 'FAILED'}", soft_wrap=True)
    for problem in result.errors + result.warnings:
        console.print(f"  {problem}", soft_wrap=True, highlight=False)
    return path


@one_writer("export", lambda run_dir, out, *_, **__: out)
def export_run(run_dir: Path, out: Path, dtype: str = "bf16", fmt: str = "auto", force: bool = False) -> Path:
    """Export RUN_DIR/final (what ``eyas train`` wrote) as a drafter directory in a format of the run's drafter family
    (``fmt`` auto: the family's first; :mod:`eyas.families`); a DRAFT_DIR exported from another run, or other data in
    ``out``, is replaced only with ``force``."""
    from safetensors.torch import load_file

    from eyas import families
    from eyas.export.files import DRAFT_FILES, TORCH_DTYPES, write_draft_dir
    from eyas.manifest import REMEDIES, input_record, read_json_object, write_manifest
    from eyas.outputs import StageOut
    from eyas.target.facts import target_input
    from eyas.train.resume import run_options

    stage_out = StageOut.claim("export", out, force)
    run_dir = Path(run_dir)
    final = run_dir / "final"
    if not (final / "model.safetensors").is_file():
        raise EyasError(f"{run_dir} has no final/model.safetensors: train it first (eyas train ... --out {run_dir})")
    if dtype not in TORCH_DTYPES:
        raise EyasError(f"--dtype must be bf16, fp16 or fp32, not {dtype!r}")
    known = families.export_formats()
    if fmt != "auto" and fmt not in known:
        raise EyasError(f"--format must be auto or one of {', '.join(known)}, not {fmt!r}")
    _verify_run_dir(run_dir)
    recorded = read_json_object(final / "drafter_config.json", REMEDIES["train"])
    if not (run_dir / "train_options.json").is_file():
        raise EyasError(f"{run_dir}/train_options.json is missing: RUN_DIR is incomplete; train it again into a new --out")
    options = run_options(read_json_object(run_dir / "train_options.json", REMEDIES["train"]))
    family = families.of_run(options, str(run_dir))
    fmt = next(iter(family.formats)) if fmt == "auto" else fmt
    if fmt not in family.formats:
        raise EyasError(f"{run_dir} trained a {family.name} drafter, which --format {fmt} cannot hold: use --format "
                        f"{' or '.join(family.formats)} (or leave --format out)")
    target = _target_facts(run_dir, options)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
    config, tensors, card = family.export(recorded, load_file(str(final / "model.safetensors")), fmt, dtype, options,
                                          report, target, Path(out))
    stage = ExportOptions(run_dir=run_dir, out=Path(out), format=fmt, dtype=dtype, force=force)
    inputs = [input_record("run", run_dir), target_input(target)]
    stage_out.keep_input_places(inputs)  # a re-export of the same run replaces it (in any format or dtype)
    stage_out.need((final / "model.safetensors").stat().st_size + 2**20, "the export")  # fp32 weights: at most
    with stage_out.writing(f"{out} is unchanged (a DRAFT_DIR is replaced only once complete): free space, then rerun"):
        return write_draft_dir(out, config, tensors, card,
                               then=lambda tmp: write_manifest(tmp, "export", stage, inputs, DRAFT_FILES, target=target))


def _verify_run_dir(run_dir: Path) -> None:
    """RUN_DIR's files as its manifest records them (sizes, SHA-256); a run from before runs had manifests: the files
    export reads present and the weights' safetensors header consistent with their size."""
    from eyas.export.files import safetensors_header
    from eyas.manifest import MANIFEST, REMEDIES, verify_stage_dir

    if (run_dir / MANIFEST).is_file():
        verify_stage_dir(run_dir, "train")
        return
    for name in ("final/drafter_config.json", "train_options.json"):
        if not (run_dir / name).is_file():
            raise EyasError(f"{run_dir / name} is missing: RUN_DIR is incomplete; {REMEDIES['train']}")
    safetensors_header(run_dir / "final" / "model.safetensors", REMEDIES["train"])


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
