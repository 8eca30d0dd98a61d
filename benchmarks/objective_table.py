"""Issue 46's objective / data table: finished runs side by side, by the τ `eyas train --predict` reported for each.

Each RUN_DIR is a finished `eyas train --predict …` run (every variant trained at equal tokens: the same --max-steps and
--token-budget, or say so); the first is the baseline ("base"), and the table names every other run by the options it
was started with unlike the baseline (--objective lk-lambda, --ttt-steps 5, --data mix-all, …), and gives its
training tokens, the holdout's simulated τ, and, per dataset, the predicted τ of bench's chains at each temperature
and answer length (what `eyas bench` measures on those prompts: benchmarks/predict_vs_bench.py checks it against
bench's loop).

  python3 benchmarks/objective_table.py RUN_DIR [RUN_DIR ...] [--out table.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SKIPPED = {"out", "resume", "force", "max_steps", "checkpoint_every", "keep", "verify"}  # not what a variant is


def variants(options: list[dict]) -> list[str]:
    """Each run's name: the started options it sets unlike the first run, the baseline (``base``; a path by its last
    component: ``--data mix-all``)."""
    first = options[0]
    keys = sorted({k for o in options for k in o} - SKIPPED)

    def shown(value) -> str:
        return Path(value).name if isinstance(value, str) and "/" in value else str(value)

    return [" ".join(f"--{k.replace('_', '-')} {shown(o.get(k))}" for k in keys
                     if json.dumps(o.get(k), sort_keys=True) != json.dumps(first.get(k), sort_keys=True)) or "base"
            for o in options]


def table(runs: list[Path]) -> str:
    """The Markdown table of ``runs`` (module docstring)."""
    records = [(json.loads((run / "train_options.json").read_text()), json.loads((run / "report.json").read_text()))
               for run in runs]
    started = [{k: v for k, v in o.items() if k != "segments"} for o, _ in records]  # as each run started
    names = variants(started)
    columns = sorted({(r["mode"], r["temperature"], r["max_new_tokens"]) for _, report in records
                      for r in (report.get("final_eval") or {}).get("predicted", [])},
                     key=lambda c: (c[1], int(c[0].split(":")[1]), c[2]))
    head = ["run", "variant", "tokens", "holdout τ", "dataset"] + [
        f"{mode}{' drawn' if t > 0 else ''} T={t:g} @{n}" for mode, t, n in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, name, (_, report) in zip(runs, names, records, strict=True):
        final = report.get("final_eval") or {}
        rows = final.get("predicted", [])
        for dataset in dict.fromkeys(r["dataset"] for r in rows) or ["—"]:
            cells = {(r["mode"], r["temperature"], r["max_new_tokens"]): r["tau"] for r in rows if r["dataset"] == dataset}
            lines.append("| " + " | ".join([run.name, name, f"{report.get('tokens', 0):,}", f"{final.get('tau', 0):.2f}",
                                            dataset] + [f"{cells[c]:.2f}" if c in cells else "—" for c in columns]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished RUN_DIRs of eyas train --predict")
    parser.add_argument("--out", type=Path, help="write the table here too")
    args = parser.parse_args()
    text = table(args.runs)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
