"""`eyas demo --quick` runs every stage on the demo target and ends with the τ / speedup table."""

import json

import pytest
from typer.testing import CliRunner

from eyas.cli import app


@pytest.mark.slow
def test_demo_runs_every_stage_and_ends_with_the_table(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "aux [1, " in out and ", 1728] at layer ids [2, 15, 27]" in out
    assert "layer 2: 0, layer 15: 0, layer 27: 0, final: 0 → identical" in out
    assert "eyas demo — done in" in out and "speedup" in out and "REPORT_DIR" in out
    assert (tmp_path / "bench" / "report.json").is_file() and (tmp_path / "bench" / "acceptance.png").is_file()
    rows = json.loads((tmp_path / "bench" / "report.json").read_text())["rows"]
    assert {r["dataset"] for r in rows} == {"mt-bench", "humaneval", "sharegpt-holdout"}
    assert all(r["matches_plain"] == r["prompts"] for r in rows)  # greedy speculation is lossless on the real target
    assert "passes the EAGLE-3 contract" in out and (tmp_path / "draft" / "config.json").is_file()
    assert (tmp_path / "data" / "manifest.json").is_file() and "samples (train / holdout)" in out
    assert (tmp_path / "features" / "manifest.json").is_file() and "shards written" in out
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file() and "simulated τ" in out
