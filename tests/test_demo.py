"""`eyas demo` runs what is built on the demo target and says what is not built yet."""

import pytest
from typer.testing import CliRunner

from eyas.cli import app


@pytest.mark.slow
def test_demo_captures_verifies_prepares_and_lists_missing_stages(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "aux [1, " in out and ", 1728] at layer ids [2, 15, 27]" in out
    assert "layer 2: 0, layer 15: 0, layer 27: 0, final: 0 → identical" in out
    assert "not built yet" in out and "eyas bench" in out
    assert "passes the EAGLE-3 contract" in out and (tmp_path / "draft" / "config.json").is_file()
    assert (tmp_path / "data" / "manifest.json").is_file() and "samples (train / holdout)" in out
    assert (tmp_path / "features" / "manifest.json").is_file() and "shards written" in out
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file() and "simulated τ" in out
