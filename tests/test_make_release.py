"""benchmarks/make_release.py: an exported bf16 drafter becomes releases/NAME with its card, `eyas check` still passes,
and the manifest pins every file; an fp32 export is refused. Bench and holdout reports are the real ones a device run
wrote (benchmarks/results/2026-12-03_h200_release-mixing)."""

import json
import sys
from pathlib import Path

import pytest

import zoo
from eyas.export.check import check_draft_dir
from eyas.export.stage import export_run
from eyas.releases import release_problems
from eyas.train.options import TrainOptions
from eyas.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "benchmarks" / "results" / "2026-12-03_h200_release-mixing" / "compare"
PARTIAL = ROOT / "benchmarks" / "results" / "2026-12-03_h200_release-final" / "t1" / "report.json"  # stopped at 24 of 30


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    target, _, features = zoo.tiny_store(root)
    train(TrainOptions(target=target, features=features, out=root / "run", max_steps=2, token_budget=256,
                       checkpoint_every=2, ttt_steps=2, eval_batches=1))
    return root / "run"


def make_release(monkeypatch, *args):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from make_release import main

    monkeypatch.setattr(sys, "argv", ["make_release.py", *map(str, args)])
    main()


def common(run_dir, releases):
    return ["--metrics", run_dir / "metrics.jsonl", "--data", "tiny", "--command", "eyas train ...", "--commit", "abc1234",
            "--machine", "the CPU", "--date", "2026-12-03", "--releases", releases]


def test_a_bf16_export_is_released_checked_and_pinned(run_dir, tmp_path, monkeypatch):
    export_run(run_dir, tmp_path / "draft", "bf16")
    releases = tmp_path / "releases"
    make_release(monkeypatch, tmp_path / "draft", "--name", "tiny-eagle3", *common(run_dir, releases),
                 "--bench", RECORDED / "bench-s-t0-all-b.json", "--holdout-tau", RECORDED / "holdout_tau.json")
    out = releases / "tiny-eagle3"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "manifest.json", "model.safetensors"]
    assert check_draft_dir(out).ok and release_problems(root=releases) == []
    card = (out / "README.md").read_text()
    recorded = json.loads((RECORDED / "bench-s-t0-all-b.json").read_text())
    assert all(f"**{row['tau']:.2f}**" in card for row in recorded["rows"])  # every bench row's τ
    assert "holdout t08" in card and "eyas generate --target demo --draft releases/tiny-eagle3" in card
    (out / "README.md").write_text(card + "edited\n")  # the manifest notices an edit after the release
    assert release_problems(root=releases) == ["tiny-eagle3/README.md: sha256 differs from MANIFEST.sha256"]


def test_without_benches_the_card_says_so_and_fp32_is_refused(run_dir, tmp_path, monkeypatch):
    export_run(run_dir, tmp_path / "draft", "bf16")
    releases = tmp_path / "releases"
    make_release(monkeypatch, tmp_path / "draft", "--name", "early", *common(run_dir, releases))
    assert "Not benched yet" in (releases / "early" / "README.md").read_text()
    assert check_draft_dir(releases / "early").ok
    export_run(run_dir, tmp_path / "fp32", "fp32")
    with pytest.raises(SystemExit, match="export it with --dtype bf16"):
        make_release(monkeypatch, tmp_path / "fp32", "--name", "wide", *common(run_dir, releases))
    assert not (releases / "wide").exists()


def test_a_partial_bench_is_marked_under_its_own_heading(run_dir, tmp_path, monkeypatch):
    export_run(run_dir, tmp_path / "draft", "bf16")
    releases = tmp_path / "releases"
    make_release(monkeypatch, tmp_path / "draft", "--name", "part", *common(run_dir, releases),
                 "--bench", RECORDED / "bench-s-t0-all-b.json", "--bench", PARTIAL)
    lines = (releases / "part" / "README.md").read_text().splitlines()

    def under(heading):  # the second line under a report's heading: its table, or the mark of a partial report
        return lines[next(n for n, line in enumerate(lines) if line.startswith(heading)) + 2]

    assert under("`eyas bench` at T = 0.0").startswith("| dataset |")
    assert under("`eyas bench` at T = 1.0").startswith("**Partial**: interrupted (SIGTERM) after 24 of 30 prompts")


def test_the_card_carries_the_runs_prediction_and_benchs_measurement_beside_it(run_dir, tmp_path, monkeypatch):
    """The τ the run predicted (eyas train --predict: its report.json beside metrics.jsonl) is on the release's card,
    as on the exported one; with --predict-vs-bench, bench's τ on the same prompts beside each prediction."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    rows = [{"dataset": "mt-bench", "mode": "chain:5", "temperature": t, "max_new_tokens": 256, "prompts": 10, "tau": tau}
            for t, tau in ((0.0, 2.0), (1.0, 1.5))]
    report = json.loads((run / "report.json").read_text())
    report["final_eval"] = {**report["final_eval"], "predicted": rows, "predicted_by": "compile+lean"}
    (run / "report.json").write_text(json.dumps(report))
    measured = tmp_path / "pvb-256.json"
    measured.write_text(json.dumps({"rows": [{**rows[0], "bench": 2.05}, {**rows[1], "bench": 1.5}]}))
    export_run(run_dir, tmp_path / "draft", "bf16")
    releases = tmp_path / "releases"
    args = common(run, releases)
    make_release(monkeypatch, tmp_path / "draft", "--name", "foretold", *args, "--predict-vs-bench", measured)
    card = (releases / "foretold" / "README.md").read_text()
    assert "## The τ eyas bench will measure" in card and "compile+lean" in card
    assert "| mt-bench | chain:5 | 0 | 256 | 2.000 | 2.050 | -2.4 % |" in card
    assert "| mt-bench | chain:5 | 1 | 256 | 1.500 | 1.500 | +0.0 % |" in card
    assert check_draft_dir(releases / "foretold").ok
