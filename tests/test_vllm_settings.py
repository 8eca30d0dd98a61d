"""The vLLM engine settings of a capture: the user's, and eyas' default for each one left out (vllm_settings.py,
the rules the worker runs under vLLM's Python), and the options that feed them (capture/options.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import zoo
from eyas.capture.options import CaptureOptions
from eyas.capture.vllm_client import engine_request
from eyas.capture.vllm_settings import choose_settings, target_facts
from eyas.cli import app
from eyas.errors import EyasError

MLA = target_facts(zoo.deepseek_v3_config().to_dict())  # as transformers saves it: no topk_method / scoring_func
MLA_YARN = target_facts(zoo.deepseek_v3_config(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 10000.0}).to_dict())
LLAMA = target_facts({"model_type": "llama", "rope_scaling": {"rope_type": "default"}})
NONE = {"dtype": None, "attention_backend": None, "compilation_config": None}


def test_target_facts_read_mla_rope_and_routing_from_the_config():
    assert MLA == {"model_type": "deepseek_v3", "mla": True, "rope_type": "default", "routing": {}}
    assert MLA_YARN["rope_type"] == "yarn" and not LLAMA["mla"]
    wrapped = target_facts({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", "kv_lora_rank": 512,
                                                                      "topk_method": "noaux_tc"}})
    assert wrapped["mla"] and wrapped["routing"] == {"topk_method": "noaux_tc"}


def test_mla_on_an_amx_cpu_defaults_to_bf16():
    settings, notes = choose_settings(NONE, on_cpu=True, amx=True, target=MLA)
    assert settings["dtype"] == "bfloat16" and "attention_backend" not in settings
    assert any("AMX_MLA" in note for note in notes)


def test_mla_on_a_cpu_without_amx_defaults_to_fp32():
    settings, _ = choose_settings(NONE, on_cpu=True, amx=False, target=MLA)
    assert settings["dtype"] == "float32" and "attention_backend" not in settings


def test_fp32_asked_for_on_an_amx_cpu_gets_the_cpu_mla_backend():
    settings, notes = choose_settings({**NONE, "dtype": "float32"}, on_cpu=True, amx=True, target=MLA)
    assert settings["dtype"] == "float32" and settings["attention_backend"] == "CPU_MLA"
    mine, _ = choose_settings({**NONE, "dtype": "float32", "attention_backend": "AMX_MLA"}, True, True, MLA)
    assert mine["attention_backend"] == "AMX_MLA"  # the user's choice stands
    cpu_mla, _ = choose_settings({**NONE, "attention_backend": "cpu_mla"}, True, True, MLA)
    assert cpu_mla["dtype"] == "float32"  # CPU_MLA asked for: vLLM will not pick AMX, so fp32 works


def test_rotary_workaround_only_for_mla_under_default_rope_on_cpu():
    settings, notes = choose_settings(NONE, on_cpu=True, amx=False, target=MLA)
    assert settings["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert sum("rotary" in note for note in notes) == 1
    for on_cpu, target in ((True, MLA_YARN), (True, LLAMA), (False, MLA)):
        assert "compilation_config" not in choose_settings(NONE, on_cpu=on_cpu, amx=False, target=target)[0]


def test_rotary_workaround_merges_into_the_users_compilation_config_and_yields_to_it():
    merged, _ = choose_settings({**NONE, "compilation_config": {"custom_ops": ["-rms_norm"], "level": 0}}, True, False, MLA)
    assert merged["compilation_config"] == {"custom_ops": ["-rms_norm", "-rotary_embedding"], "level": 0}
    kept, notes = choose_settings({**NONE, "compilation_config": {"custom_ops": ["+rotary_embedding"]}}, True, False, MLA)
    assert kept["compilation_config"] == {"custom_ops": ["+rotary_embedding"]} and not any("rotary" in n for n in notes)


def test_deepseek_v3_routing_is_supplied_only_where_the_config_lacks_it():
    settings, notes = choose_settings(NONE, on_cpu=False, amx=False, target=MLA)
    assert settings["hf_overrides"] == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert settings["dtype"] == "auto"  # a GPU: the checkpoint's dtype
    said = {**MLA, "routing": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
    assert "hf_overrides" not in choose_settings(NONE, on_cpu=False, amx=False, target=said)[0]
    user = choose_settings({**NONE, "hf_overrides": {"scoring_func": "softmax"}}, False, False, MLA)[0]
    assert user["hf_overrides"] == {"scoring_func": "softmax", "topk_method": "noaux_tc"}


def test_engine_request_parses_named_options_and_passthrough(tmp_path):
    options = CaptureOptions(target="t", data=tmp_path, out=tmp_path / "f", engine="vllm", tensor_parallel_size=8,
                             compilation_config='{"custom_ops": ["none"]}',
                             vllm_args=["max_num_seqs=16", "kv_cache_dtype=fp8", "hf_overrides={\"a\": 1}"])
    request = engine_request(options)
    assert request["tensor_parallel_size"] == 8 and request["dtype"] is None
    assert request["compilation_config"] == {"custom_ops": ["none"]}
    assert (request["max_num_seqs"], request["kv_cache_dtype"], request["hf_overrides"]) == (16, "fp8", {"a": 1})


@pytest.mark.parametrize("item, says", [("model=/other", "eyas sets model itself"),
                                        ("dtype=float16", "use --vllm-dtype")])
def test_engine_request_refuses_what_eyas_sets_or_names(tmp_path, item, says):
    options = CaptureOptions(target="t", data=tmp_path, out=tmp_path / "f", engine="vllm", vllm_args=[item])
    with pytest.raises(EyasError, match=says):
        engine_request(options)


@pytest.mark.parametrize("flags, names", [
    (["--engine", "vllm", "--vllm-arg", "max_num_seqs"], "--vllm-arg"),
    (["--engine", "vllm", "--compilation-config", "{not json"], "--compilation-config"),
    (["--engine", "vllm", "--vllm-arg", "speculative_config={}"], "--vllm-arg"),
    (["--engine", "vllm", "--vllm-dtype", "fp32"], "--vllm-dtype"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
])
def test_capture_refuses_bad_vllm_settings_before_writing(tmp_path, flags, names):
    data = zoo.write_data_dir(tmp_path / "data", sizes=(("train", 2), ("holdout", 1)))
    out = tmp_path / "features"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = CliRunner().invoke(app, ["capture", "--target", str(tmp_path / "no-target"), "--data", data,
                                      "--out", str(out), *flags])
    assert result.exit_code == 2, result.output
    message = result.output.strip()
    assert message.startswith("error:") and len(message.splitlines()) == 1 and names in message, message
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_settings_come_from_a_run_config(tmp_path):
    from eyas.config import build_config

    raw = {"target": "t", "workdir": str(tmp_path), "stages": ["capture"],
           "capture": {"engine": "vllm", "tensor_parallel_size": 8, "enable_expert_parallel": True,
                       "compilation_config": json.dumps({"custom_ops": ["-rotary_embedding"]}),
                       "vllm_args": ["max_num_seqs=16"]}}
    capture = build_config(raw, "run.toml").options("capture")
    assert capture.tensor_parallel_size == 8 and capture.enable_expert_parallel
    assert engine_request(capture)["max_num_seqs"] == 16
