"""`eyas demo --quick` runs every stage on the demo target, benches a released drafter beside its own (τ and greedy
equality in fp32, speed in the default dtype), and ends with the τ / speedup table of both and a verdict drawn from
the numbers."""

import json

import pytest
from typer.testing import CliRunner

from eyas.cli import app


def random_demo_drafter(directory):
    """A random-weight EAGLE-3 drafter of the demo target's widths (SmolLM2-135M: H 576, 30 layers), exported."""
    from eyas.families.eagle3.export import draft_config, draft_tensors
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
def test_demo_runs_every_stage_and_ends_with_the_table(tmp_path, monkeypatch):
    import eyas.engine.loading

    monkeypatch.setattr(eyas.engine.loading, "cpu_has_native_bf16", lambda: True)  # the speed run, on any CPU
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
    for bench in ("bench", "bench-released"):  # τ and greedy == plain: fp32, where speculation is lossless bit for bit
        assert json.loads((tmp_path / bench / "report.json").read_text())["settings"]["dtype"] == "float32"
    speed = json.loads((tmp_path / "bench-released-bf16" / "report.json").read_text())
    assert speed["settings"]["dtype"] == "bfloat16" and speed["settings"]["repeats"] == 3
    assert [(r["dataset"], r["mode"]) for r in speed["rows"]] == [(r["dataset"], r["mode"]) for r in rows]
    assert "│ released " in out and "│ this run " in out and "speed in" in out and "│ bf16" in out
    assert "The released drafter beat plain decoding" in out or "The released drafter did not beat plain decoding" in out


def bench_result(dtype: str, speedups: dict[tuple[str, str], float]):
    """A bench's result whose (dataset, mode) rows run at ``speedups`` × plain's 10 tok/s."""
    from eyas.bench.run import BenchResult, ModeResult

    datasets = {}
    for (dataset, mode), speedup in speedups.items():
        results = datasets.setdefault(dataset, [ModeResult("plain", prompts=1, new_tokens=10, seconds=1.0,
                                                           prompt_rates=[10.0])])
        results.append(ModeResult(mode, prompts=1, new_tokens=10, seconds=1 / speedup, rounds=5, accepted=5,
                                  matches_plain=1, prompt_rates=[10.0 * speedup]))
    return BenchResult(datasets=datasets, settings={"dtype": dtype})


def test_the_closing_line_says_whether_the_released_drafters_best_mode_beat_plain_everywhere():
    from eyas.demo import _verdict

    fp32 = bench_result("float32", {("mt-bench", "chain:1"): 0.7, ("humaneval", "chain:1"): 0.8})
    faster = bench_result("bfloat16", {("mt-bench", "chain:1"): 1.05, ("humaneval", "chain:1"): 1.5,
                                       ("mt-bench", "tree:4,2,2"): 1.2, ("humaneval", "tree:4,2,2"): 1.3})
    said = _verdict({"this run": fp32, "released": fp32}, {"released": faster})
    assert "beat plain decoding on every dataset on this machine in bf16: its best mode, tree:4,2,2, ran mt-bench " \
           "1.20×, humaneval 1.30×." in said  # the best mode: the one whose slowest dataset is fastest
    slower = bench_result("bfloat16", {("mt-bench", "chain:1"): 0.95, ("humaneval", "chain:1"): 1.5})
    said = _verdict({"this run": fp32, "released": fp32}, {"released": slower})
    assert "did not beat plain decoding on every dataset on this machine in bf16: its one mode, chain:1, ran " \
           "mt-bench 0.95×, humaneval 1.50×." in said
    said = _verdict({"this run": fp32, "released": fp32}, {})  # no speed run (no native bf16): the fp32 figures
    assert "did not beat plain decoding on every dataset on this machine in fp32" in said and "no native bf16" in said
