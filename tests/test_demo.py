"""`eyas demo --quick` runs every stage on the demo target, benches a released drafter beside its own, and ends with
the τ / speedup table of both."""

import json

import pytest
from typer.testing import CliRunner

from eyas.cli import app


def random_demo_drafter(directory):
    """A random-weight EAGLE-3 drafter of the demo target's widths (SmolLM2-135M: H 576, 30 layers), exported."""
    from eyas.export.eagle3 import draft_config, draft_tensors
    from eyas.export.files import write_draft_dir
    from test_drafter_consistency import random_drafter, tiny_config
    from test_import_layouts import weights

    drafter = random_drafter(tiny_config(hidden_size=576, target_hidden_size=576, num_attention_heads=9,
                                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                                         draft_vocab_size=1024, layer_ids=[2, 15, 27]))
    config = draft_config(drafter.config, "llama", 30, "fp32")
    write_draft_dir(directory, config, draft_tensors(weights(drafter), config, "fp32"), "")
    return directory


@pytest.mark.slow
def test_demo_runs_every_stage_and_ends_with_the_table(tmp_path):
    released = random_demo_drafter(tmp_path / "released")
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", str(out), "--released", str(released)],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    tmp_path = out
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
    # the released drafter, benched the same way: its rows in the table, its report beside the demo's
    released_rows = json.loads((tmp_path / "bench-released" / "report.json").read_text())["rows"]
    assert [(r["dataset"], r["mode"]) for r in released_rows] == [(r["dataset"], r["mode"]) for r in rows]
    assert all(r["matches_plain"] == r["prompts"] for r in released_rows)
    assert "│ released " in out and "│ this run " in out and "released drafter's speedup on this machine is" in out
