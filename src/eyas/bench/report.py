"""REPORT_DIR of ``eyas bench``: report.json (everything), report.md (the tables), acceptance.png, and with serving
engines speedup.png (speedup vs concurrency) and vllm/ (the vLLM worker's request and lines)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eyas.bench.run import BenchResult
from eyas.bench.serving import engine_rows
from eyas.bench.vllm_engine import eyas_counterpart
from eyas.io import atomic_path, write_json_atomic

REPORT_FILES = ("report.json", "report.md", "acceptance.png")  # always written
ENGINE_FILES = ("speedup.png",)  # written when serving engines were measured
MARKERS = (*REPORT_FILES, *ENGINE_FILES, "vllm")  # what an unfinished bench leaves in REPORT_DIR


def rows(result: BenchResult) -> list[dict]:
    """One row per dataset and speculative mode, with the baseline's speed beside it.

    ``speedup`` pools the dataset (all tokens over all seconds); ``speedup_range`` is the lowest and
    highest of the prompts' own speedups, the spread a reader needs to trust the pooled figure.
    """
    out = []
    for dataset, results in result.datasets.items():
        plains = {r.temperature: r for r in results if r.mode == "plain"}  # each temperature's baseline
        for mode in results:
            if mode.mode == "plain":
                continue
            plain = plains[mode.temperature]
            each = [spec / base for spec, base in zip(mode.prompt_rates, plain.prompt_rates, strict=True) if base]
            out.append({
                "dataset": dataset, "mode": mode.mode, "temperature": mode.temperature, "prompts": mode.prompts,
                "tau": mode.tau,
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


def equality_note(result: BenchResult) -> str | None:
    """What "greedy == plain" means when eyas decoded in a dtype other than float32 (None in float32, or with no greedy
    row): there a count below the prompts' is rounding, not a broken engine."""
    dtype = result.settings.get("dtype", "float32")
    if dtype == "float32" or all(r["matches_plain"] is None for r in rows(result)):
        return None
    return (f"Decoded in {dtype}: a near-tie between two tokens may round one way in a one-token forward and the other "
            "in a k-token verify, so a greedy answer may part from plain decoding's without anything being wrong; "
            "token-for-token equality is guaranteed in float32 (--dtype fp32).")


def markdown(result: BenchResult, header: dict) -> str:
    lines = [f"# eyas bench — {header.get('target')} with {header.get('draft')}", ""]
    if result.partial:
        lines += [f"**Partial report**: {result.partial}; the figures cover those prompts only.", ""]
    lines += [f"- {k}: {v}" for k, v in {**header, **result.settings}.items()]
    lines += ["", "| dataset | T | mode | prompts | τ | tok/s spec | tok/s plain | speedup | greedy == plain |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows(result):
        same = "—" if r["matches_plain"] is None else f"{r['matches_plain']}/{r['prompts']}"
        lines.append(f"| {r['dataset']} | {r['temperature']:g} | {r['mode']} | {r['prompts']} | {r['tau']:.3f} | "
                     f"{r['tokens_per_second']:.1f} | {r['plain_tokens_per_second']:.1f} | {speedup_text(r)} | {same} |")
    if (note := equality_note(result)) is not None:
        lines += ["", note]
    lines += ["", "Acceptance per position (share of rounds whose accepted path reached depth i+1):", ""]
    for r in rows(result):
        lines.append(f"- {r['dataset']} T = {r['temperature']:g} {r['mode']}: "
                     + " ".join(f"{x:.3f}" for x in r["accepted_per_position"]))
    lines += engine_markdown(result)
    return "\n".join(lines) + "\n"


def comparison(result: BenchResult) -> list[dict]:
    """eyas' engine against each serving engine on the same prompts, one row per (engine, mode, dataset): τ of both and
    their ratio at concurrency 1 and, where both returned output ids, how many answers are equal token for token.
    Greedy answers in float32 on both sides must be equal; in bf16 near-ties may flip."""
    rows = []
    engine_temperature = result.settings.get("engine_temperature", 0.0)  # the engines' one temperature
    eyas_modes = {(dataset, m.mode): m for dataset, results in result.datasets.items() for m in results
                  if m.temperature == engine_temperature}
    for level in result.engines:
        if level.concurrency != 1:
            continue
        for dataset in level.datasets():
            ours = eyas_modes.get((dataset, eyas_counterpart(level.mode) if level.mode != "speculative" else None))
            if ours is None and level.mode == "speculative":  # a server's own drafting: compare with eyas' first chain
                ours = next((m for (d, name), m in eyas_modes.items() if d == dataset and name.startswith("chain")), None)
            if ours is None:
                continue
            theirs = [r for r in level.requests if r.dataset == dataset]
            equal = None
            if ours.outputs and all(r.tokens is not None for r in theirs):
                equal = sum(r.tokens == out for r, out in zip(theirs, ours.outputs, strict=False))
            measured = level.acceptance(dataset)
            rows.append({
                "engine": level.engine, "mode": level.mode, "eyas_mode": ours.mode, "dataset": dataset,
                "prompts": len(theirs), "equal_outputs": equal,
                "tau_eyas": None if level.mode == "plain" else ours.tau,
                "tau_engine": None if measured is None else measured[0],
                "tau_ratio": (measured[0] / ours.tau if measured is not None and level.mode != "plain" else None),
            })
    return rows


def engine_markdown(result: BenchResult) -> list[str]:
    """The serving engines' section of report.md: speed and τ per concurrency level, then the comparison with eyas."""
    if not result.engines:
        return []
    lines = ["", "## Serving engines", "",
             "Closed loops: at most C requests in flight, a new one sent as one finishes; speedup = tokens/s over the same "
             "engine's plain run at the same C.", "",
             "| engine | mode | concurrency (in flight) | tok/s | TPOT ms | speedup | τ | τ by dataset | where τ comes from |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in engine_rows(result.engines):
        tpot = "—" if r["time_per_output_token_ms"] is None else f"{r['time_per_output_token_ms']:.1f}"
        tau = "—" if r["tau"] is None else f"{r['tau']:.3f}"
        by = ", ".join(f"{d} {t:.3f}" for d, t in r["tau_by_dataset"].items()) or "—"
        speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        lines.append(f"| {r['engine']} | {r['mode']} | {r['concurrency']} ({r['in_flight']}) | {r['tokens_per_second']:.1f} | "
                     f"{tpot} | {speedup} | {tau} | {by} | {r['tau_note'] or '—'} |")
    lines += [f"- {note}" for note in result.engine_notes]
    compared = comparison(result)
    if compared:
        dtype = result.settings.get("dtype")
        engine_dtype = (result.settings.get("vllm") or {}).get("dtype")
        lines += ["", f"eyas' engine ({dtype}) against the engines at concurrency 1 (vLLM {engine_dtype or 'as served'}); "
                  "greedy answers in float32 on both sides must be equal token for token:", "",
                  "| engine | mode | dataset | prompts | τ eyas | τ engine | engine / eyas | equal outputs |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in compared:
            def show(x, fmt="{:.3f}"):
                return "—" if x is None else fmt.format(x)
            equal = "—" if c["equal_outputs"] is None else f"{c['equal_outputs']}/{c['prompts']}"
            lines.append(f"| {c['engine']} | {c['mode']} (eyas {c['eyas_mode']}) | {c['dataset']} | {c['prompts']} | "
                         f"{show(c['tau_eyas'])} | {show(c['tau_engine'])} | {show(c['tau_ratio'])} | {equal} |")
    return lines


@contextmanager
def _plot(path: Path) -> Iterator:
    """A 7 × 4 figure's axis to draw on; then the grid, a legend when something is labelled, and the PNG written
    atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    try:
        yield axis
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[1]:
            axis.legend(fontsize=7)
        figure.tight_layout()
        with atomic_path(path) as tmp:
            figure.savefig(tmp, format="png", dpi=120)
    finally:
        plt.close(figure)


def plot_speedup(result: BenchResult, path: Path) -> None:
    """Speedup over the same engine's plain run against concurrency, one line per (engine, mode)."""
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in engine_rows(result.engines):
        if r["speedup"] is not None:
            lines.setdefault((r["engine"], r["mode"]), []).append((r["concurrency"], r["speedup"]))
    pooled: dict[str, list[float]] = {}  # eyas' engine, one request at a time: pooled over datasets, a point at 1
    engine_temperature = result.settings.get("engine_temperature", 0.0)
    for results in result.datasets.values():
        for mode in (m for m in results if m.temperature == engine_temperature):
            totals = pooled.setdefault(mode.mode, [0.0, 0.0])
            totals[0] += mode.new_tokens
            totals[1] += mode.seconds
    plain = pooled.pop("plain", None)
    with _plot(path) as axis:
        for (engine, mode), points in lines.items():
            points.sort()
            axis.plot([c for c, _ in points], [x for _, x in points], marker="o", label=f"{engine} {mode}")
        for mode, (tokens, seconds) in pooled.items():
            if plain and plain[0] and seconds:
                axis.plot([1], [(tokens / seconds) / (plain[0] / plain[1])], marker="s", linestyle="none",
                          label=f"eyas {mode} (one request at a time)")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency (requests in flight)")
        axis.set_ylabel("speedup over plain decoding")


def plot_acceptance(result: BenchResult, path: Path) -> None:
    curves = [(f"{r['dataset']} T = {r['temperature']:g} {r['mode']} (τ {r['tau']:.2f})", r["accepted_per_position"])
              for r in rows(result)]
    lowest = min((r["concurrency"] for r in engine_rows(result.engines)), default=None)
    curves += [(f"{r['engine']} {r['mode']}, concurrency {r['concurrency']} (τ {r['tau']:.2f})", r["accepted_per_position"])
               for r in engine_rows(result.engines) if r["accepted_per_position"] and r["concurrency"] == lowest]
    with _plot(path) as axis:
        for label, shares in curves:
            axis.plot(range(1, len(shares) + 1), shares, marker="o", label=label)
        axis.set_xlabel("draft depth")
        axis.set_ylabel("share of rounds accepted to this depth")
        axis.set_ylim(0, 1)


def write_report(result: BenchResult, out: Path, header: dict) -> tuple[str, ...]:
    """Write REPORT_DIR's files; return their names (what the manifest records)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        **header, "partial": result.partial, "settings": result.settings, "rows": rows(result),
        "datasets": {name: [m.to_dict() for m in results] for name, results in result.datasets.items()},
    }
    if result.engines:
        report["engines"] = {"rows": engine_rows(result.engines), "comparison": comparison(result),
                             "notes": result.engine_notes, "levels": [level.to_dict() for level in result.engines]}
    write_json_atomic(out / "report.json", report)
    with atomic_path(out / "report.md") as tmp:
        Path(tmp).write_text(markdown(result, header))
    plot_acceptance(result, out / "acceptance.png")
    if result.engines:
        plot_speedup(result, out / "speedup.png")
        return (*REPORT_FILES, *ENGINE_FILES)
    return REPORT_FILES
