"""Training curves of one or more runs in one picture, from each RUN_DIR's metrics.jsonl.

    python benchmarks/plot_training.py RUN_DIR [RUN_DIR ...] --out curves.png [--label NAME ...]

Three panels against training tokens: the training loss (smoothed over 20 steps), the holdout's
step-0 acceptance and the holdout's simulated τ (at each checkpoint evaluation). Runs of one
ablation share the axes, so a gap between them is visible at a glance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_metrics(run_dir: Path) -> tuple[list[tuple[float, float]], list[tuple[float, float, float]]]:
    """(training points (tokens, loss), evaluation points (tokens, step-0 acceptance, τ)) of one run."""
    train, evals, tokens = [], [], 0.0
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        tokens += record.get("tokens", 0)
        if "loss" in record:
            train.append((tokens, record["loss"]))
        if "eval" in record:
            e = record["eval"]
            evals.append((tokens, e["acceptance_cumulative"][0], e["tau"]))
    return train, evals


def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", action="append", help="one per run, in order (default: the folder names)")
    parser.add_argument("--title", default="drafter training")
    args = parser.parse_args()
    labels = args.label or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(labels)} labels for {len(args.runs)} runs")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_ax, accept_ax, tau_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run, label in zip(args.runs, labels, strict=True):
        train, evals = read_metrics(run)
        if train:
            loss_ax.plot([t / 1e6 for t, _ in train], smooth([v for _, v in train]), label=label)
        if evals:
            accept_ax.plot([t / 1e6 for t, _, _ in evals], [a for _, a, _ in evals], marker="o", label=label)
            tau_ax.plot([t / 1e6 for t, _, _ in evals], [tau for _, _, tau in evals], marker="o", label=label)
    for ax, name in ((loss_ax, "training loss (TTT-weighted, 20-step mean)"), (accept_ax, "holdout step-0 acceptance"),
                     (tau_ax, "holdout simulated τ")):
        ax.set_xlabel("training tokens (M)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    tau_ax.legend(fontsize=8)
    figure.suptitle(args.title)
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
