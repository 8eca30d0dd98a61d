"""``eyas capture --check``: is this FEATURES_DIR intact, and does it hold what the target computes?"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eyas.data.samples import read_samples
from eyas.errors import EyasError
from eyas.io import file_sha256
from eyas.manifest import MANIFEST
from eyas.store.error_model import COMPUTE_NOISE, TensorFit, noise_bound
from eyas.store.reader import FeatureStore
from eyas.store.shards import StoreManifest
from eyas.store.verify import REPAIR, shard_problems
from eyas.target.facts import target_mismatch


@dataclass
class CheckReport:
    """Checksums, counts, and the re-capture comparison per tensor (eyas.store.error_model)."""

    shards: int = 0
    bad_checksums: list[str] = field(default_factory=list)
    count_problems: list[str] = field(default_factory=list)
    recaptured: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # comparisons that could not be made, and why
    dtype: str = ""  # the store's
    compute: dict[str, str | None] = field(default_factory=dict)  # capture / re-capture → compute dtype (None: not recorded)
    bound: float = 0.0  # on each token's relative error beyond the store's rounding
    bound_for: str = ""  # the compute dtype the bound is for
    tensors: dict[str, TensorFit] = field(default_factory=dict)  # "layer L" / "final" → its comparison

    @property
    def ok(self) -> bool:
        """True when nothing is corrupt or missing and every token's error beyond rounding is within the bound."""
        return not self.bad_checksums and not self.count_problems and all(
            fit.worst_rel <= self.bound for fit in self.tensors.values())


def check_store(directory: Path, target: str | None = None, samples: int = 4, trust_remote_code: bool = False,
                compute_dtype: str = "auto") -> CheckReport:
    """Verify checksums and counts; re-capture ``samples`` random samples with the live target, in ``compute_dtype``
    (a torch dtype's name, or ``auto``: the target's default)."""
    directory = Path(directory)
    manifest = StoreManifest.read(directory)
    report = CheckReport(shards=len(manifest.shards), dtype=manifest.dtype)
    bad = shard_problems(directory, manifest.shards)
    report.bad_checksums = [f"{name}: {problem}; {REPAIR}" for name, problem in bad.items()]
    data_dir = _captured_data_dir(manifest, report)
    for split in manifest.options["splits"]:
        store = FeatureStore(directory, split)
        expected = {s.id: len(s.input_ids) for s in read_samples(data_dir / f"{split}.parquet")} if data_dir else None
        ids = store.sample_ids
        if len(set(ids)) != len(ids):
            report.count_problems.append(f"{split}: a sample appears more than once")
        if expected is not None and manifest.options.get("max_gb") is None and set(ids) != set(expected):
            report.count_problems.append(f"{split}: {len(set(expected) - set(ids))} samples of DATA_DIR missing, "
                                         f"{len(set(ids) - set(expected))} unknown")
        intact = [k for k, shard in enumerate(store.shards) if shard.file not in bad]  # a damaged shard cannot be opened
        if sum(store.shards[k].tokens for k in intact) != sum(store.shard_lengths(intact)):  # offsets only: no state read
            report.count_problems.append(f"{split}: token counts differ from the manifest")
    if samples and not report.bad_checksums:
        _recapture(directory, manifest, target or manifest.target["spec"], samples, report, trust_remote_code,
                   compute_dtype)
    return report


def _captured_data_dir(manifest: StoreManifest, report: CheckReport) -> Path | None:
    """The DATA_DIR the store was captured from, when it is still where the capture recorded it and unchanged; else None,
    with the reason in ``report.skipped``."""
    data_dir = Path(manifest.data["path"])
    if not (data_dir / MANIFEST).is_file():
        report.skipped.append(f"sample ids not compared with DATA_DIR: {data_dir}, where the store was captured from, is "
                              "gone (moved or deleted); checksums, token counts and the re-capture do not need it")
        return None
    if file_sha256(data_dir / MANIFEST) != manifest.data["manifest_sha256"]:
        report.skipped.append(f"sample ids not compared with DATA_DIR: {data_dir} is no longer the DATA_DIR the store was "
                              "captured from (its manifest.json changed since)")
        return None
    return data_dir


def _recapture(directory, manifest, target_spec, samples, report, trust_remote_code, compute_dtype) -> None:
    from eyas.target import capture_hidden_states, load_target

    dtype = None if compute_dtype == "auto" else getattr(torch, compute_dtype)
    target = load_target(target_spec, dtype=dtype, trust_remote_code=trust_remote_code)
    live = {"num_layers": target.layout.num_layers, "hidden_size": target.layout.hidden_size,
            "vocab_size": target.layout.vocab_size}
    mismatch = target_mismatch(manifest.target, live, identity=False)  # the re-capture itself compares the rest
    if mismatch is not None:
        raise EyasError(f"target {target_spec!r} is not the one {directory / MANIFEST} was captured from, "
                        f"{manifest.target.get('spec')!r} ({mismatch}); pass that one with --target")
    report.compute = {"capture": manifest.compute_dtype, "re-capture": str(target.model.dtype).removeprefix("torch.")}
    report.bound, report.bound_for = noise_bound(*report.compute.values())
    store = FeatureStore(directory, manifest.options["splits"][0], dtype=torch.float32)
    rng = random.Random(0)
    width = manifest.target["hidden_size"]
    for i in rng.sample(range(len(store)), min(samples, len(store))):
        item = store.stored(i)  # read once: the fp8 scales are the stored rounding's, the decoded states are compared
        scales = {name: item.pop(f"{name}_scale") for name in ("aux", "final")} if manifest.dtype == "fp8" else None
        for name in ("aux", "final"):
            item[name] = store.decode(item[name], scales and scales[name])
        live = capture_hidden_states(target.model, target.layout, item["input_ids"].long(), layer_ids=manifest.layer_ids)
        report.recaptured.append(item["id"])
        pairs = {f"layer {lid}": (item["aux"][:, k * width:(k + 1) * width], live.aux[0, :, k * width:(k + 1) * width],
                                  scales and scales["aux"][:, k:k + 1]) for k, lid in enumerate(manifest.layer_ids)}
        pairs["final"] = (item["final"], live.final[0], scales and scales["final"])
        for name, (stored, fresh, scale) in pairs.items():
            report.tensors.setdefault(name, TensorFit()).add(item["id"], stored, fresh.float().cpu(), manifest.dtype, scale)


def print_check(console: Console, report: CheckReport) -> None:
    """Print the check as a table, one row per layer id and the final hidden; exit code 1 when it failed."""
    table = Table(title="eyas capture --check", show_header=True)
    for column in ("tensor", "tokens", "worst rel. error beyond rounding", "at", "worst ‖stored − Q(live)‖/‖live‖",
                   "min cos", "bound", ""):
        table.add_column(column)
    for name, fit in report.tensors.items():
        verdict = "[green]ok[/]" if fit.worst_rel <= report.bound else "[red]FAIL[/]"
        table.add_row(name, str(fit.tokens), f"{fit.worst_rel:.3g}", fit.worst_at, f"{fit.worst_rounded:.3g}",
                      f"{fit.min_cos:.6f}", f"{report.bound:g}", verdict)
    console.print(f"{report.shards} shards; checksums {'ok' if not report.bad_checksums else 'BAD'}; "
                  f"counts {'ok' if not report.count_problems else 'BAD'}; re-captured {len(report.recaptured)} samples")
    for problem in report.bad_checksums + report.count_problems:
        console.print(f"  [red]{problem}[/]", soft_wrap=True, highlight=False)
    for skipped in report.skipped:
        console.print(f"  [yellow]skipped:[/] {skipped}", soft_wrap=True, highlight=False)
    if report.tensors:
        console.print(table)
        console.print(_error_model_line(report), soft_wrap=True, highlight=False)
    console.print("[green]OK[/]" if report.ok else "[red]FAILED[/]")
    if not report.ok:
        raise SystemExit(1)


def _error_model_line(report: CheckReport) -> str:
    """How the comparison was judged, and what it cannot see."""
    compute = ", ".join(f"{side} {dtype or 'not recorded (a store made before eyas recorded it)'}"
                        for side, dtype in report.compute.items())
    line = (f"per token, the stored {report.dtype} states against the live forward rounded the same way (compute dtype: "
            f"{compute}); bound {report.bound:g} = the noise of two {report.bound_for} forwards")
    if report.bound > COMPUTE_NOISE["float32"]:
        line += (f": [yellow]{report.bound_for} compute cannot resolve errors below {report.bound:.0%} (such as a ~1 % "
                 "corruption); only float32 capture and re-capture resolve those[/]")
    return line
