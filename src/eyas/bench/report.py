"""REPORT_DIR of ``eyas bench``: report.json (everything), report.md (the table), acceptance.png."""

from __future__ import annotations

from pathlib import Path

from eyas.bench.run import BenchResult
from eyas.io import atomic_path, write_json_atomic

REPORT_FILES = ("report.json", "report.md", "acceptance.png")


def rows(result: BenchResult) -> list[dict]:
    """One row per dataset and speculative mode, with the baseline's speed beside it.

    ``speedup`` pools the dataset (all tokens over all seconds); ``speedup_range`` is the lowest and
    highest of the prompts' own speedups, the spread a reader needs to trust the pooled figure.
    """
    out = []
    for dataset, results in result.datasets.items():
        plain = results[0]
        for mode in results[1:]:
            each = [spec / base for spec, base in zip(mode.prompt_rates, plain.prompt_rates, strict=True) if base]
            out.append({
                "dataset": dataset, "mode": mode.mode, "prompts": mode.prompts, "tau": mode.tau,
                "tokens_per_second": mode.tokens_per_second, "plain_tokens_per_second": plain.tokens_per_second,
                "speedup": mode.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0,
                "speedup_range": [min(each), max(each)] if each else None,
                "accepted_per_position": mode.accepted_per_position,
                "matches_plain": mode.matches_plain,
            })
    return out


def speedup_text(row: dict, short: bool = False) -> str:
    """``0.61× (0.55–0.70 over 3 prompts)``: the pooled speedup and its spread over prompts (``short``: no count)."""
    text = f"{row['speedup']:.2f}×"
    low_high = row.get("speedup_range")
    if low_high and row["prompts"] > 1:
        text += f" ({low_high[0]:.2f}–{low_high[1]:.2f}" + (")" if short else f" over {row['prompts']} prompts)")
    return text


def markdown(result: BenchResult, header: dict) -> str:
    lines = [f"# eyas bench — {header.get('target')} with {header.get('draft')}", ""]
    if result.partial:
        lines += [f"**Partial report**: {result.partial}; the figures cover those prompts only.", ""]
    lines += [f"- {k}: {v}" for k, v in {**header, **result.settings}.items()]
    lines += ["", "| dataset | mode | prompts | τ | tok/s spec | tok/s plain | speedup | greedy == plain |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows(result):
        same = "—" if r["matches_plain"] is None else f"{r['matches_plain']}/{r['prompts']}"
        lines.append(f"| {r['dataset']} | {r['mode']} | {r['prompts']} | {r['tau']:.3f} | {r['tokens_per_second']:.1f} | "
                     f"{r['plain_tokens_per_second']:.1f} | {speedup_text(r)} | {same} |")
    lines += ["", "Acceptance per position (share of rounds whose accepted path reached depth i+1):", ""]
    for r in rows(result):
        lines.append(f"- {r['dataset']} {r['mode']}: " + " ".join(f"{x:.3f}" for x in r["accepted_per_position"]))
    return "\n".join(lines) + "\n"


def plot_acceptance(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for r in rows(result):
        depths = range(1, len(r["accepted_per_position"]) + 1)
        axis.plot(depths, r["accepted_per_position"], marker="o", label=f"{r['dataset']} {r['mode']} (τ {r['tau']:.2f})")
    axis.set_xlabel("draft depth")
    axis.set_ylabel("share of rounds accepted to this depth")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120)
    plt.close(figure)


def write_report(result: BenchResult, out: Path, header: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "report.json", {
        **header, "partial": result.partial, "settings": result.settings, "rows": rows(result),
        "datasets": {name: [m.to_dict() for m in results] for name, results in result.datasets.items()},
    })
    with atomic_path(out / "report.md") as tmp:
        Path(tmp).write_text(markdown(result, header))
    plot_acceptance(result, out / "acceptance.png")
    return out
