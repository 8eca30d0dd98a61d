"""`eyas bench --engine vllm` and `--server URL`: τ, concurrency, the report and every error a user will hit, against a
fake vLLM package (tests/fake_vllm: vLLM 0.32's offline API shapes) and fake servers (tests/fake_servers.py: vLLM's
and SGLang's response shapes). Both answer with real greedy decodes of the tiny target, so eyas' engine must agree
with them token for token."""

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eyas.bench.server import acceptance_counters, parse_metrics
from eyas.bench.serving import Level, Request, engine_rows
from eyas.bench.vllm_engine import eyas_counterpart
from eyas.cli import app
from fake_servers import FakeServer
from test_bench import setup  # noqa: F401 — the bench tests' tiny target, DATA_DIR and drafter

FAKE_VLLM = Path(__file__).with_name("fake_vllm")


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The fake vLLM on the worker's path; its LLM(...) calls recorded in the returned file."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_VLLM), os.environ.get("PYTHONPATH")])))
    record = tmp_path / "llm_calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setenv("EYAS_VLLM_PYTHON", sys.executable)
    return record


def bench(made, out, *flags):
    root, target, data = made
    return CliRunner().invoke(app, ["bench", "--target", target, "--out", str(out), "--dataset", "sharegpt-holdout",
                                    "--data", str(data), "--max-new-tokens", "10", "--device", "cpu", "--dtype", "fp32",
                                    *flags])  # fp32: eyas' greedy answers equal plain decoding's and the engines' ones


def test_vllm_beside_eyas_levels_tau_and_token_equality(setup, fake_vllm, tmp_path):  # noqa: F811
    root, _, _ = setup
    result = bench(setup, tmp_path / "report", "--draft", str(root / "draft"), "--engine", "eyas,vllm",
                   "--mode", "chain:3,tree:8,3,3", "--concurrency", "1,2")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    engines = report["engines"]
    rows = {(r["mode"], r["concurrency"]): r for r in engines["rows"]}
    assert set(rows) == {("plain", 1), ("plain", 2), ("chain:3", 1), ("chain:3", 2)}  # vLLM drafts chains only
    assert any("tree:8,3,3: measured in eyas' engine only" in note for note in engines["notes"])
    levels = [Level.from_dict(level) for level in engines["levels"]]
    for level in levels:
        if level.mode == "chain:3":  # τ from the requests' own histograms == τ from the level's counters
            pooled = level.acceptance()
            counters = level.counters
            assert pooled[0] == pytest.approx(1 + counters["accepted"] / counters["drafts"])
            assert pooled[1] == pytest.approx([a / counters["drafts"] for a in counters["per_position"]])
            assert 1 < pooled[0] < 4
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert [c["speculative_config"] for c in calls] == [
        None, {"method": "eagle3", "model": str((root / "draft").resolve()), "num_speculative_tokens": 3}]
    for call in calls:  # CPU: float32 and eager; the levels' largest concurrency; the stats get_metrics() needs
        assert (call["dtype"], call["enforce_eager"], call["max_num_seqs"], call["disable_log_stats"]) == (
            "float32", True, 2, False)
    assert calls[1]["per_request_spec_decode_metrics"] == "summary"
    compared = {(c["mode"], c["dataset"]): c for c in engines["comparison"]}
    prompts = rows[("plain", 1)]["prompts"]
    eyas_chain = next(r for r in report["rows"] if r["mode"] == "chain:3")
    for mode in ("plain", "chain:3"):  # greedy in float32 on both sides: the same answers
        assert compared[(mode, "sharegpt-holdout")]["equal_outputs"] == prompts > 0
    chain = compared[("chain:3", "sharegpt-holdout")]
    assert chain["tau_eyas"] == pytest.approx(eyas_chain["tau"])
    assert chain["tau_ratio"] == pytest.approx(chain["tau_engine"] / chain["tau_eyas"])
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Serving engines" in text and f"| vllm | chain:3 (eyas chain:3) | sharegpt-holdout | {prompts} |" in text
    assert (tmp_path / "report" / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((tmp_path / "report" / "manifest.json").read_text())
    assert "speedup.png" in json.dumps(manifest)


def test_vllm_refusing_the_drafter_is_one_line_with_its_own_message(setup, fake_vllm, tmp_path):  # noqa: F811
    root, _, _ = setup
    broken = tmp_path / "draft"
    broken.mkdir()
    (broken / "config.json").write_text((root / "draft" / "config.json").read_text())
    result = bench(setup, tmp_path / "report", "--draft", str(broken), "--engine", "vllm", "--concurrency", "1")
    assert result.exit_code == 2
    assert f"vLLM refused the drafter {broken}" in result.output
    assert f"Cannot find any model weights with `{broken}`" in result.output


def test_no_vllm_python_and_a_python_without_vllm(setup, monkeypatch, tmp_path):  # noqa: F811
    root, _, _ = setup
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    result = bench(setup, tmp_path / "a", "--draft", str(root / "draft"), "--engine", "vllm")
    assert result.exit_code == 2 and "needs a Python environment that has vLLM" in result.output
    result = bench(setup, tmp_path / "b", "--draft", str(root / "draft"), "--engine", "vllm", "--vllm-python",
                   sys.executable)  # this test Python has no vllm (the fake is not on its path here)
    assert result.exit_code == 2 and "cannot import vllm" in result.output


def test_what_to_measure_must_add_up(setup, tmp_path):  # noqa: F811
    result = bench(setup, tmp_path / "a", "--engine", "vllm")
    assert result.exit_code == 2 and "--engine vllm needs --draft DRAFT_DIR" in result.output
    result = bench(setup, tmp_path / "b", "--server-plain", "http://127.0.0.1:9")
    assert result.exit_code == 2 and "pass --server URL too" in result.output


def test_a_vllm_server_against_its_plain_twin_and_eyas(setup, tmp_path):  # noqa: F811
    root, target, _ = setup
    with FakeServer("vllm", target) as speculative, FakeServer("vllm", target, speculative=False) as plain:
        result = bench(setup, tmp_path / "report", "--draft", str(root / "draft"), "--engine", "eyas", "--mode",
                       "chain:3", "--server", speculative.url + "/v1/", "--server-plain", plain.url,
                       "--concurrency", "1,4", "--temperature", "0")
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / "report" / "report.json").read_text())
        rows = {(r["mode"], r["concurrency"]): r for r in report["engines"]["rows"]}
        assert set(rows) == {("plain", 1), ("plain", 4), ("speculative", 1), ("speculative", 4)}
        assert rows[("speculative", 1)]["tau"] is not None
        # the two levels' τ, pooled, are the server's own count over everything it decoded
        levels = [Level.from_dict(level) for level in report["engines"]["levels"] if level["mode"] == "speculative"]
        drafts = sum(level.counters["drafts"] for level in levels)
        accepted = sum(level.counters["accepted"] for level in levels)
        assert 1 + accepted / drafts == pytest.approx(speculative.tau())
        assert speculative.max_in_flight == min(4, rows[("speculative", 4)]["prompts"]) or 1 < speculative.max_in_flight <= 4
        assert rows[("speculative", 4)]["speedup"] > 1  # fewer engine steps per token: faster, as with real drafting
        compared = {(c["mode"], c["dataset"]): c for c in report["engines"]["comparison"]}
        prompts = rows[("plain", 1)]["prompts"]
        assert compared[("plain", "sharegpt-holdout")]["equal_outputs"] == prompts  # return_token_ids: real ids back
        assert "vLLM /metrics" in rows[("speculative", 1)]["tau_note"]


@pytest.mark.parametrize("kind, has_tau, says", [
    ("sglang", True, "SGLang /metrics"),
    ("sglang-old", False, "only sglang:spec_accept_length"),
    ("sglang-nometrics", False, "--enable-metrics"),
])
def test_sglang_servers_give_tau_only_where_they_count_it(setup, tmp_path, kind, has_tau, says):  # noqa: F811
    _, target, _ = setup
    with FakeServer(kind, target) as server:
        result = bench(setup, tmp_path / "report", "--server", server.url, "--concurrency", "2")
        assert result.exit_code == 0, result.output
        row = json.loads((tmp_path / "report" / "report.json").read_text())["engines"]["rows"][0]
        assert says in row["tau_note"] and (row["tau"] is not None) == has_tau
        if has_tau:
            assert row["tau"] == pytest.approx(server.tau())
        assert says in (tmp_path / "report" / "report.md").read_text()


def test_server_errors_are_one_clear_line(setup, tmp_path):  # noqa: F811
    _, target, _ = setup
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = bench(setup, tmp_path / "a", "--server", down)
    assert result.exit_code == 2 and f"cannot reach {down}" in result.output and "is the server running" in result.output
    with FakeServer("html", target) as other:
        result = bench(setup, tmp_path / "b", "--server", other.url)
        assert result.exit_code == 2 and "does not answer as an OpenAI-compatible server" in result.output
        assert "HTTP 404" in result.output
    with FakeServer("vllm", target) as server:
        result = bench(setup, tmp_path / "c", "--server", server.url, "--server-model", "someone-else")
        assert result.exit_code == 2 and "serves served-target, not 'someone-else'" in result.output
        with FakeServer("vllm", target, model="another-target", speculative=False) as plain:
            result = bench(setup, tmp_path / "d", "--server", server.url, "--server-plain", plain.url)
            assert result.exit_code == 2 and "both servers must serve the same model" in result.output


def test_prometheus_text_and_counter_differences():
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 1000.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7963242635538237e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 1850.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 800.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 450.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 600.0
"""
    after = parse_metrics(text)
    assert after["vllm:spec_decode_num_drafts_total"] == 1010.0  # summed over the data-parallel engines
    assert after["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == [800.0, 600.0, 450.0]
    before = parse_metrics(text.replace("1000.0", "900.0").replace("1850.0", "1700.0").replace("800.0", "700.0"))
    counters, note = acceptance_counters("vllm", before, after)
    assert counters == {"drafts": 100.0, "accepted": 150.0, "per_position": [100.0, 0.0, 0.0]} and "vLLM" in note
    assert acceptance_counters("vllm", parse_metrics("vllm:generation_tokens_total 5\n"),
                               parse_metrics("vllm:generation_tokens_total 9\n"))[0] is None


def test_rows_speedup_against_the_same_engine_and_level():
    def level(mode, concurrency, seconds, histogram=None):
        return Level("vllm", mode, concurrency, seconds,
                     [Request("mt-bench", 10, 1.0, 0.1, histogram=histogram), Request("humaneval", 10, 1.0, 0.1,
                                                                                      histogram=histogram)])

    rows = engine_rows([level("plain", 1, 2.0), level("chain:2", 1, 1.0, [1, 1, 2]), level("plain", 4, 1.0),
                        level("chain:2", 4, 0.8, [2, 2, 0])])
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    assert by[("chain:2", 1)]["speedup"] == pytest.approx(2.0) and by[("chain:2", 4)]["speedup"] == pytest.approx(1.25)
    assert by[("plain", 1)]["speedup"] is None
    # histogram [1, 1, 2]: 4 steps accepting 0, 1, 2, 2 drafts → τ = 1 + 5/4; reached depth 1: 3/4, depth 2: 2/4
    assert by[("chain:2", 1)]["tau"] == pytest.approx(2.25)
    assert by[("chain:2", 1)]["accepted_per_position"] == pytest.approx([0.75, 0.5])
    assert by[("chain:2", 1)]["tau_by_dataset"] == {"mt-bench": pytest.approx(2.25), "humaneval": pytest.approx(2.25)}
    assert by[("chain:2", 1)]["time_per_output_token_ms"] == pytest.approx(100.0)  # (1.0 − 0.1) s over 9 tokens


def test_a_dflash_drafter_runs_in_vllm_with_its_block_and_in_eyas_engine(setup, fake_vllm, tmp_path):  # noqa: F811
    from eyas.families.dflash.config import dflash_config_from_target
    from eyas.families.dflash.export import write_dflash_dir
    from eyas.families.dflash.model import DFlashDrafter
    from eyas.target.loading import load_target_config

    _, target, _ = setup
    torch.manual_seed(0)
    config = dflash_config_from_target(load_target_config(target)[0], [1, 2], block_size=4, draft_layers=1)
    write_dflash_dir(tmp_path / "dflash", DFlashDrafter(config), "fp32")  # block 4: three proposals a round
    result = bench(setup, tmp_path / "report", "--draft", str(tmp_path / "dflash"), "--engine", "eyas,vllm",
                   "--concurrency", "1")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    engines = report["engines"]
    assert [r["mode"] for r in engines["rows"]] == ["plain", "dflash:3"]
    assert any("DFlash drafter (block 4)" in note for note in engines["notes"])
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert calls[1]["speculative_config"] == {"method": "dflash", "model": str((tmp_path / "dflash").resolve()),
                                              "num_speculative_tokens": 3}
    # eyas' engine decodes it too: with no --mode, its whole block as one chain, every answer the plain one
    assert report["settings"]["modes"] == ["chain:3"]
    rows = {row["mode"]: row for row in report["datasets"]["sharegpt-holdout"]}
    assert rows["chain:3"]["matches_plain"] == rows["chain:3"]["prompts"] > 0, rows
    # and the report compares vLLM's dflash:3 with eyas' chain:3 (the same rounds), not only the plain runs
    compared = {row["mode"]: row for row in engines["comparison"]}
    assert compared["dflash:3"]["eyas_mode"] == "chain:3" and compared["dflash:3"]["tau_eyas"] == rows["chain:3"]["tau"]
    refused = bench(setup, tmp_path / "other", "--draft", str(tmp_path / "dflash"), "--engine", "eyas", "--mode",
                    "tree:10,3,4")
    assert refused.exit_code == 2 and "DFlash block drafter (block 4)" in refused.output


def test_each_sampling_rule_runs_in_both_engines_under_its_own_name(setup, fake_vllm, tmp_path):  # noqa: F811
    """--draft-sampling / --verification lists: eyas' engine decodes every rule beside the same plain run, vLLM gets
    each as its own draft_sample_method / rejection_sample_method, and the report pairs the rows of one rule."""
    root, _, _ = setup
    result = bench(setup, tmp_path / "report", "--draft", str(root / "draft"), "--engine", "eyas,vllm",
                   "--mode", "chain:3,tree:8,3,3", "--concurrency", "1", "--temperature", "1",
                   "--draft-sampling", "greedy,probabilistic", "--verification", "standard,block")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    rules = ["chain:3", "chain:3 block", "chain:3 drawn", "chain:3 drawn+block"]
    # a tree runs its top-k and its drawn children, each verified token by token (block verification is a chain rule)
    assert [r["mode"] for r in report["rows"]] == [*rules, "tree:8,3,3", "tree:8,3,3 drawn"]
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    asked = [{k: v for k, v in (c["speculative_config"] or {}).items() if k.endswith("sample_method")} for c in calls]
    assert asked == [{}, {}, {"draft_sample_method": "greedy", "rejection_sample_method": "block"},
                     {"draft_sample_method": "probabilistic", "rejection_sample_method": "standard"},
                     {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}]
    compared = {c["mode"]: c for c in report["engines"]["comparison"]}
    assert all(compared[rule]["eyas_mode"] == rule for rule in rules)
    refused = bench(setup, tmp_path / "other", "--draft", str(root / "draft"), "--mode", "tree:8,3,3",
                    "--temperature", "1", "--verification", "block")
    assert refused.exit_code != 0 and "chain modes" in refused.output


def test_dflash_blocks_in_vllm_are_compared_with_the_same_rule_in_eyas():
    assert eyas_counterpart("dflash:15") == "chain:15"
    assert eyas_counterpart("dflash:15 drawn+block") == "chain:15 drawn+block"
    assert eyas_counterpart("chain:5 drawn") == "chain:5 drawn"
