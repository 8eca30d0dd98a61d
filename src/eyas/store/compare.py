"""Two FEATURES_DIRs of the same data, compared state by state: how far one engine's (or parallel layout's) capture
is from another's, per layer id and for the final hidden."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.store.reader import FeatureStore


def compare_stores(store: Path, reference: Path) -> dict[str, dict[str, float]]:
    """Per tensor ("layer L", "final"): ``max_abs`` = max |Δ| and ``max_rel`` = the largest per-sample max |Δ| / max |x|
    (x from ``reference``), over every sample of every split both stores hold."""
    got_manifest = FeatureStore(store).manifest
    layer_ids = got_manifest.layer_ids
    if FeatureStore(reference).manifest.layer_ids != layer_ids:
        raise EyasError(f"{store} and {reference} hold other layer ids; compare stores captured with the same --layer-ids")
    width = got_manifest.target["hidden_size"]
    worst: dict[str, dict[str, float]] = {}
    for split in got_manifest.options["splits"]:
        got, want = FeatureStore(store, split, dtype=torch.float32), FeatureStore(reference, split, dtype=torch.float32)
        by_id = {sample_id: i for i, sample_id in enumerate(want.sample_ids)}
        if sorted(by_id) != sorted(got.sample_ids):
            raise EyasError(f"{store} and {reference} hold other samples in {split}; compare captures of one DATA_DIR")
        for i in range(len(got)):
            a = got[i]
            b = want[by_id[a["id"]]]
            pairs = {f"layer {lid}": (a["aux"][:, k * width:(k + 1) * width], b["aux"][:, k * width:(k + 1) * width])
                     for k, lid in enumerate(layer_ids)}
            pairs["final"] = (a["final"], b["final"])
            for name, (x, y) in pairs.items():
                diff = (x - y).abs().max().item()
                row = worst.setdefault(name, {"max_abs": 0.0, "max_rel": 0.0})
                row["max_abs"] = max(row["max_abs"], diff)
                row["max_rel"] = max(row["max_rel"], diff / max(y.abs().max().item(), 1e-12))
    return worst


def describe_differences(worst: dict[str, dict[str, float]]) -> str:
    """One line: each tensor's max |Δ| and max relative difference."""
    return ", ".join(f"{name} {row['max_abs']:.2e} ({row['max_rel']:.2e} rel)" for name, row in worst.items())
