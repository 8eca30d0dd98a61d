"""`eyas inspect`: layout, sizes and layer ids in every spelling, from the config alone."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import zoo
from eyas.cli import app

runner = CliRunner()


@pytest.mark.slow
def test_inspect_demo_prints_30_layers_and_ids_2_15_27():
    # A real process through the console entry point, as a user runs it.
    command = [sys.executable, "-m", "eyas", "inspect", "demo", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["num_layers"] == 30
    assert info["layer_ids"] == [2, 15, 27]
    assert info["sglang_layer_ids"] == [1, 14, 26]
    assert info["specforge_layer_ids"] == [1, 14, 26]
    assert info["hidden_size"] == 576 and info["vocab_size"] == 49152
    assert info["layers_path"] == "model.layers" and info["chat_template"] is True
    assert info["dtype"] == "float32" and info["device_plan"].startswith("cpu")
    table = runner.invoke(app, ["inspect", "demo"])
    assert table.exit_code == 0
    assert "[2, 15, 27]" in table.output and "LlamaForCausalLM" in table.output


def test_inspect_61_layer_deepseek_v3_config(tmp_path):
    config = zoo.deepseek_v3_config(num_hidden_layers=61, hidden_size=7168, vocab_size=129280)
    config.save_pretrained(tmp_path)
    result = runner.invoke(app, ["inspect", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "model.layers: N = 61" in out
    assert "[2, 30, 58]  (input of decoder layer L)" in out
    assert "SGLang spelling" in out and "│ [2, 30, 58]" in out
    assert "[1, 29, 57]  (output of layer L-1)" in out
    assert "no tokenizer found" in out
    info = json.loads(runner.invoke(app, ["inspect", str(tmp_path), "--json"]).output)
    assert (info["layer_ids"], info["sglang_layer_ids"], info["specforge_layer_ids"]) == ([2, 30, 58], [2, 30, 58], [1, 29, 57])
    assert info["architecture"] == "DeepseekV3ForCausalLM" and info["hidden_size"] == 7168


def test_inspect_multimodal_wrapper_config(tmp_path):
    zoo.qwen2_5_vl().config.save_pretrained(tmp_path)
    info = json.loads(runner.invoke(app, ["inspect", str(tmp_path), "--json"]).output)
    assert info["layers_path"] == "model.language_model.layers"
    assert info["num_layers"] == 8 and info["hidden_size"] == 64


def test_inspect_bad_target_exits_2_with_what_was_tried(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "nope" / "model")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "nope" in result.output
