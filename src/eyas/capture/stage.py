"""``eyas capture``: DATA_DIR → FEATURES_DIR, resumable, data-parallel under torchrun.

Work is planned up front (:mod:`eyas.store.plan`): shards of length-sorted, token-budget batches.
Shard ``i`` belongs to rank ``i % world_size``. Each finished shard is renamed into place and
recorded in its rank's partial manifest (``manifest.rank{r}.json``, replaced atomically); at the
end rank 0 merges them into ``manifest.json`` with ``complete: true``. A rerun — after a crash,
a kill -9, or with another number of ranks — skips every shard already recorded and recomputes
the rest exactly as planned, so the result is identical to an uninterrupted run.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eyas.capture.options import CaptureOptions
from eyas.data.fits_target import require_data_fits
from eyas.data.samples import read_samples
from eyas.data.vocab import VOCAB_FILE
from eyas.distributed import barrier, init_distributed
from eyas.errors import EyasError
from eyas.io import atomic_path, file_sha256, remove_stale_temps
from eyas.manifest import MANIFEST, file_problem, input_record, manifest_fields, output_record, verify_stage_dir
from eyas.out_lock import one_writer
from eyas.outputs import StageOut, human_bytes
from eyas.progress import progress_bar
from eyas.store.async_writer import ShardWriterPool
from eyas.store.plan import ShardPlan, plan_shards
from eyas.store.shards import DTYPES, ShardRecord, StoreManifest, bytes_per_token, shard_name, write_shard
from eyas.target.facts import target_facts, target_input
from eyas.target.fingerprint import weights_fingerprint
from eyas.target.layer_ids import resolve_layer_ids
from eyas.target.loading import load_target_config

SHARDS = "*-[0-9][0-9][0-9][0-9][0-9].safetensors"  # shard_name's files
MARKERS = ("manifest.rank*.json", SHARDS, ".vllm")  # what a capture writes before its manifest.json


@dataclass
class CaptureReport:
    """What this process did (rank-local counts) and what the store holds."""

    rank: int = 0
    world_size: int = 1
    shards_written: int = 0
    shards_skipped: int = 0
    samples_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    estimated_bytes: int = 0
    samples_capped: int = 0  # left out by --max-gb
    already_complete: bool = False
    seconds: float = 0.0  # the whole stage, model loading included
    capture_seconds: float = 0.0  # first batch to last shard on disk


@dataclass
class _Run:
    """One process's capture: its options, its --out, its place among the ranks, and the report it fills in."""

    options: CaptureOptions
    stage_out: StageOut
    rank: int
    world: int
    report: CaptureReport

    @property
    def out(self) -> Path:
        return self.stage_out.out


@dataclass
class _Inputs:
    """What the capture reads, loaded and checked: the target's config source, the layers to tap, DATA_DIR's samples,
    and the store's manifest before its shards (whose identity a rerun must match)."""

    source: str
    layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    data_dir: Path
    samples: dict[str, list]
    manifest: StoreManifest


@dataclass
class _Work:
    """The planned shards: every split's (all ranks'), the shards already finished, and this rank's still to write."""

    samples: dict[str, list]  # what the plans index: DATA_DIR's samples less those --max-gb leaves out
    plans: dict[str, list[ShardPlan]]
    done: dict[str, ShardRecord]
    todo: list[tuple[str, ShardPlan]]
    tokens: int  # in todo


@one_writer("capture", lambda options, *_, **__: options.out)
def capture(options: CaptureOptions, loaded=None) -> CaptureReport:
    """Run the capture stage in this process (one rank of ``WORLD_SIZE``). ``loaded``: the target already in memory
    (an :class:`eyas.target.Target` of ``options.target``'s config and weights, e.g. a rehearsal target built on the
    GPU) instead of loading it; ``options.target`` still names the directory its config and head tensors are read from."""
    started = time.perf_counter()
    _check_request(options)
    out = Path(options.out)
    stage_out = StageOut.claim("capture", out, options.force, MARKERS)
    rank, world, device = init_distributed()
    run = _Run(options, stage_out, rank, world, CaptureReport(rank=rank, world_size=world))
    inputs = _load_inputs(options)
    done = _resume_state(stage_out, inputs.manifest, rank)
    if done is None:
        if rank == 0:
            _carry_vocab_into_finished(out, inputs.data_dir)
        run.report.already_complete = True
        return run.report
    work = _plan_work(run, inputs, done)
    _make_room(run)
    _write_shards(run, inputs.manifest, work, _state_source(options, inputs, work, device, loaded))
    _finish(run, inputs, work.plans)
    run.report.seconds = time.perf_counter() - started
    return run.report


def _check_request(options: CaptureOptions) -> None:
    """Refuse, before anything is written, a --dtype eyas cannot store and engine settings it cannot honour."""
    if options.dtype not in DTYPES:
        raise EyasError(f"--dtype must be one of {', '.join(DTYPES)}, not {options.dtype!r}")
    if options.engine == "vllm":
        from eyas.capture.vllm_client import check_vllm_python, engine_request, resolve_vllm_python

        engine_request(options)  # a --vllm-arg eyas must refuse is refused before anything is written
        check_vllm_python(resolve_vllm_python(options.vllm_python))  # so is a vLLM that is not there
    elif options.vllm_settings_given():
        raise EyasError(f"--{options.vllm_settings_given()[0].replace('_', '-')} is a vLLM engine setting: add "
                        "--engine vllm, or leave it out")


def _load_inputs(options: CaptureOptions) -> _Inputs:
    """Read the target's config (and its weights' checksum) and DATA_DIR's samples, and describe the store they make."""
    config, source = load_target_config(options.target, options.trust_remote_code)
    target = target_facts(options.target, config, source)
    target.update(weights_fingerprint(options.target, options.trust_remote_code))  # training compares them
    num_layers, hidden = target["num_layers"], target["hidden_size"]
    layer_ids = resolve_layer_ids(options.layer_ids, num_layers)
    data_dir = Path(options.data)
    samples = _load_samples(data_dir, options.splits)
    require_data_fits(data_dir, options.target, options.trust_remote_code)
    manifest = StoreManifest(
        **manifest_fields("capture", options, [input_record("data", data_dir), target_input(target)]),
        target=target,
        data={"path": str(data_dir.resolve()), "manifest_sha256": file_sha256(data_dir / MANIFEST)},
        layer_ids=list(layer_ids),
        layer_id_convention="eyas/vLLM: id L = residual stream entering decoder layer L (HF hidden_states[L])",
        dtype=options.dtype,
    )
    return _Inputs(source, layer_ids, num_layers, hidden, data_dir, samples, manifest)


def _plan_work(run: _Run, inputs: _Inputs, done: dict[str, ShardRecord]) -> _Work:
    """Plan every split's shards over the samples --max-gb keeps; this rank's are those not ``done``. The report gets
    the samples left out, the shards skipped and the bytes to write."""
    options, report = run.options, run.report
    per_token = bytes_per_token(inputs.hidden_size, len(inputs.layer_ids), options.dtype)
    samples, report.samples_capped = _cap(inputs.samples, options.max_gb, per_token)
    shard_tokens = max(1, options.shard_mb * 2**20 // per_token)
    plans = {split: plan_shards([len(s.input_ids) for s in rows], options.token_budget, options.max_batch, shard_tokens)
             for split, rows in samples.items()}
    mine = [(split, plan) for split, split_plans in plans.items() for plan in split_plans if plan.index % run.world == run.rank]
    todo = [(split, plan) for split, plan in mine if shard_name(split, plan.index) not in done]
    report.shards_skipped = len(mine) - len(todo)
    tokens = sum(len(samples[split][i].input_ids) for split, plan in todo for i in plan.samples)
    report.estimated_bytes = tokens * per_token
    return _Work(samples, plans, done, todo, tokens)


def _make_room(run: _Run) -> None:
    """Refuse (unless --force) when the disk is short of the planned bytes, say how much, and create --out."""
    free = run.stage_out.need(run.report.estimated_bytes, "the capture",
                              ", cap it with --max-gb, store --dtype fp8 (half of bf16)")
    print(f"capture (rank {run.rank}): about {human_bytes(run.report.estimated_bytes)} to write, {human_bytes(free)} free "
          f"at {run.out}", flush=True)
    run.out.mkdir(parents=True, exist_ok=True)


def _write_shards(run: _Run, manifest: StoreManifest, work: _Work, states) -> None:
    """Capture this rank's shards still to write and write each on a writer thread; each one on disk is recorded in the
    rank's partial manifest (``manifest.rank{r}.json``) and counted in the report."""
    report = run.report
    records = list(work.done.values())
    loop_started = time.perf_counter()

    def recorder(split: str, plan: ShardPlan, rows: list):
        def on_written(result: tuple[int, str]) -> None:
            size, digest = result
            tokens = sum(len(s.input_ids) for s in rows)
            records.append(ShardRecord(shard_name(split, plan.index), split, plan.index, [s.id for s in rows], tokens, size, digest))
            StoreManifest(**{**asdict(manifest), "shards": records}).save(run.out / f"manifest.rank{run.rank}.json")
            report.shards_written += 1
            report.samples_written += len(rows)
            report.tokens_written += tokens
            report.bytes_written += size
            bar.note(f"{report.bytes_written / 2**30:.2f} GiB written")

        return on_written

    label = f"capture (rank {run.rank}/{run.world})" if run.world > 1 else "capture"
    writer_threads = run.options.writer_threads
    with progress_bar(label, total=work.tokens, unit="tok") as bar, \
            ShardWriterPool(workers=writer_threads, max_pending=writer_threads + 4) as writers:
        for split, plan in work.todo:
            rows = [work.samples[split][i] for i in plan.samples]
            packs = []
            for pack in states(split, plan):
                manifest.compute_dtype = pack.compute_dtype  # what capture --check judges the states' noise by
                packs.append(pack)
                bar(pack.tokens)
            writers.submit(lambda p=run.out / shard_name(split, plan.index), k=packs: _write(run.stage_out, p, k),
                           recorder(split, plan, rows))
    report.capture_seconds = time.perf_counter() - loop_started


def _load_samples(data_dir: Path, splits) -> dict:
    verify_stage_dir(data_dir, "prepare")
    if not (data_dir / VOCAB_FILE).is_file():
        raise EyasError(f"{data_dir / VOCAB_FILE} is missing: not a finished DATA_DIR; rerun eyas prepare")
    samples = {}
    for split in splits:
        path = data_dir / f"{split}.parquet"
        if not path.is_file():
            raise EyasError(f"{data_dir} has no {split}.parquet; choose splits with --splits")
        samples[split] = read_samples(path)
    return samples


def _resume_state(stage_out: StageOut, manifest: StoreManifest, rank: int) -> dict[str, ShardRecord] | None:
    """Shards already finished (by name); None when the store is complete. Refuses stores made otherwise."""
    out, force = stage_out.out, stage_out.force
    final = out / MANIFEST
    partials = sorted(out.glob("manifest.rank*.json")) if out.is_dir() else []
    existing = [] if force else [StoreManifest.load(p) for p in ([final] if final.is_file() else []) + partials]
    if force and rank == 0:  # start over (what --out held may not be a store at all: claim_out let it through)
        for path in [*out.glob(SHARDS), out / VOCAB_FILE, *partials, final]:
            path.unlink(missing_ok=True)
    barrier()
    for old in existing:
        stage_out.keep_inputs(old.identity(), manifest.identity())

    def intact(record: ShardRecord) -> bool:
        return file_problem(out / record.file, record.bytes, record.sha256, digest=False) is None

    # a complete store is done unless shards went missing (deleted because a check found them bad): those are redone
    if any(m.complete and all(intact(r) for r in m.shards) for m in existing):
        return None
    remove_stale_temps(out)  # a shard being written when the last run died
    return {record.file: record for old in existing for record in old.shards if intact(record)}


def _cap(samples: dict, max_gb: float | None, per_token: int) -> tuple[dict, int]:
    """Keep samples in DATA_DIR order while the estimated store stays under ``max_gb``."""
    if max_gb is None:
        return samples, 0
    budget = max_gb * 2**30
    kept, dropped, used = {}, 0, 0
    for split, rows in samples.items():
        kept[split] = []
        for sample in rows:
            cost = len(sample.input_ids) * per_token
            if used + cost <= budget:
                kept[split].append(sample)
                used += cost
            else:
                dropped += 1
    return kept, dropped


def _state_source(options: CaptureOptions, inputs: _Inputs, work: _Work, device, loaded=None):
    """A function (split, shard plan) → per-sample (aux, final), from the HF model or from vLLM."""
    layer_ids, samples = inputs.layer_ids, work.samples
    if options.engine == "vllm":
        from eyas.capture.vllm_states import vllm_states

        return vllm_states(options, inputs.source, layer_ids, inputs.num_layers, work.todo, samples)
    from eyas.capture.batch import capture_batch
    from eyas.target import load_target

    target = loaded or load_target(options.target, device=device, trust_remote_code=options.trust_remote_code)

    def states(split: str, plan: ShardPlan):
        """One Pack per batch: capture on the device, drop the padding there, cast or quantise there."""
        for batch in plan.batches:
            yield capture_batch(target, [samples[split][i] for i in batch], layer_ids, options.dtype,
                                options.compile_layers)

    return states


def _write(stage_out: StageOut, path: Path, packs: list) -> tuple[int, str]:
    """Write one shard (on a writer thread); a full disk ends the capture with one line, the finished shards kept.
    Under --force the store --out held is gone by then (removed first: the new one may need its space), and the same
    command would start over: the line says so, and to resume without --force."""
    advice = ("with --force the store --out held before (if any) was removed first; the shards this run finished are "
              "kept: free space, then rerun without --force to resume" if stage_out.force else
              "the shards finished before it are kept: free space, then rerun the same command to resume")
    with stage_out.writing(advice, path):
        return write_shard(path, packs)


def _finish(run: _Run, inputs: _Inputs, plans: dict) -> None:
    """Once every rank is done, rank 0 completes the store: manifest.json (with the vLLM engine that captured, if one
    did), then vLLM's raw files are removed."""
    if run.options.engine == "vllm":
        from eyas.capture.vllm_client import engine_used
        from eyas.capture.vllm_states import WORKDIR

        inputs.manifest.vllm_engine = engine_used(run.out / WORKDIR)
    barrier()
    if run.rank != 0:
        return
    _merge_manifests(run.out, inputs.data_dir, inputs.manifest, plans)
    if run.options.engine == "vllm":
        shutil.rmtree(run.out / WORKDIR, ignore_errors=True)  # the store is complete: vLLM's raw files are no longer needed


def _merge_manifests(out: Path, data_dir: Path, manifest: StoreManifest, plans: dict) -> None:
    """Copy the draft vocabulary into the store and merge the ranks' partial manifests into manifest.json, complete."""
    partials = sorted(out.glob("manifest.rank*.json"))
    loaded = [StoreManifest.load(p) for p in partials]
    records = {r.file: r for m in loaded for r in m.shards}
    # rank 0 may have captured nothing in this run (its shards were done): the compute dtype is the other runs'
    manifest.compute_dtype = manifest.compute_dtype or next((m.compute_dtype for m in loaded if m.compute_dtype), None)
    expected = [shard_name(split, plan.index) for split, split_plans in plans.items() for plan in split_plans]
    missing = [name for name in expected if name not in records]
    if missing:
        raise EyasError(f"capture finished with shards missing from the manifests: {missing[:5]}; rerun the same command")
    ordered = [records[name] for name in expected]
    outputs = [_carry_vocab(out, data_dir)]
    StoreManifest(**{**asdict(manifest), "shards": ordered, "complete": True, "outputs": outputs}).save(out / MANIFEST)
    for path in partials:
        path.unlink()


def _carry_vocab(out: Path, data_dir: Path) -> dict:
    """Copy DATA_DIR's draft vocabulary into FEATURES_DIR (offline training reads it there); its output record."""
    with atomic_path(out / VOCAB_FILE) as tmp:
        shutil.copyfile(data_dir / VOCAB_FILE, tmp)
    return output_record(out, VOCAB_FILE)


def _carry_vocab_into_finished(out: Path, data_dir: Path) -> None:
    """A store finished before stores carried their vocabulary gets it now, without capturing again."""
    manifest = StoreManifest.load(out / MANIFEST)
    if manifest.output(VOCAB_FILE) is None:
        manifest.outputs = [*manifest.outputs, _carry_vocab(out, data_dir)]
        manifest.save(out / MANIFEST)


def describe(report: CaptureReport) -> str:
    """A one-paragraph summary for the command line."""
    if report.already_complete:
        return "nothing to do: the store is complete (same target, data and options); --force to capture again"
    text = (f"rank {report.rank}/{report.world_size}: {report.shards_written} shards written, {report.shards_skipped} already done; "
            f"{report.samples_written:,} samples, {report.tokens_written:,} tokens, {report.bytes_written / 2**30:.3f} GiB "
            f"in {report.seconds:.1f} s")
    if report.capture_seconds and report.tokens_written:
        text += f" ({report.tokens_written / report.capture_seconds:,.0f} tokens/s once loaded)"
    if report.samples_capped:
        text += f"; {report.samples_capped:,} samples left out by --max-gb"
    return text

