"""Is a FEATURES_DIR what its manifest says, and was it captured from this target? Asked by offline training (before
the first step) and by ``eyas capture --check``.

Each shard's size is compared with the manifest always (free: a missing or truncated shard is caught before any read);
its SHA-256 unless the caller skips it (``eyas train --no-verify``). Hashing reads the whole store once, on a few
threads (hashlib releases the GIL), with a progress bar over bytes: a terabyte store costs minutes at disk speed, once
per training command, against hours of training on states nobody checked. Under torchrun each rank hashes its share of
the shards and all ranks agree on the verdict.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eyas.distributed import all_reduce_sum, rank_and_world
from eyas.errors import EyasError
from eyas.manifest import CHANGED, MANIFEST, file_problem
from eyas.progress import progress_bar
from eyas.store.shards import ShardRecord, StoreManifest
from eyas.target.facts import target_mismatch

REPAIR = "delete it and rerun the eyas capture command that made the store (it recaptures missing shards only)"


def shard_problems(directory: Path, shards: list[ShardRecord], digest: bool = True) -> dict[str, str]:
    """Shard file → its problem, for each shard that is missing, of another size, or — with ``digest`` — of other bytes."""
    directory = Path(directory)
    problems = {s.file: file_problem(directory / s.file, s.bytes, s.sha256, digest=False) for s in shards}
    if digest:
        rank, world = rank_and_world()
        mine = [s for i, s in enumerate(shards) if i % world == rank and problems[s.file] is None]
        changed = torch.zeros(len(shards))
        index = {s.file: i for i, s in enumerate(shards)}
        with progress_bar("verify shards", total=sum(s.bytes for s in mine) // 2**20, unit="MiB") as bar, \
                ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            for shard, problem in zip(mine, pool.map(lambda s: file_problem(directory / s.file, s.bytes, s.sha256), mine),
                                      strict=True):
                changed[index[shard.file]] = problem is not None
                bar(shard.bytes // 2**20)
        all_reduce_sum(changed)  # every rank learns what the others found
        for shard in shards:
            if changed[index[shard.file]] > 0:
                problems[shard.file] = CHANGED
    return {name: problem for name, problem in problems.items() if problem is not None}


def verify_for_training(directory: Path, manifest: StoreManifest, live: dict, verify: bool = True) -> None:
    """Refuse, in one line naming FEATURES_DIR and what to do, a store that another target wrote or whose shards are
    missing, truncated or (``verify``) changed; with ``verify`` false say what was not checked."""
    directory = Path(directory)
    captured = f"{directory / MANIFEST}: the store was captured from target {manifest.target.get('spec')!r}, not --target"
    mismatch = target_mismatch(manifest.target, live, identity=False)
    if mismatch is not None:  # its states cannot even feed a drafter of this target
        raise EyasError(f"{captured} {live['spec']!r} ({mismatch}); train with the target the store was captured from, "
                        "or capture a store with this one")
    mismatch = target_mismatch(manifest.target, live) if verify else None
    if mismatch is not None:
        raise EyasError(f"{captured} {live['spec']!r} ({mismatch}); train with the target the store was captured from, "
                        "or capture a store with this one (--no-verify skips this comparison)")
    problems = shard_problems(directory, manifest.shards, digest=verify)
    if problems:
        first = next(iter(problems))
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise EyasError(f"{directory}: {len(problems)} of {len(manifest.shards)} shards fail verification against "
                        f"{MANIFEST} ({first}: {problems[first]}{more}); delete the bad shards and rerun the eyas capture command that "
                        f"made the store (it recaptures missing shards only); eyas capture --check {directory} lists them")
    if not verify and rank_and_world()[0] == 0:
        gib = sum(s.bytes for s in manifest.shards) / 2**30
        print(f"--no-verify: not checked: the SHA-256 of {len(manifest.shards)} shards ({gib:.2f} GiB) against "
              f"{directory / MANIFEST}, nor that --target is the target they were captured from (sizes were checked)",
              flush=True)
