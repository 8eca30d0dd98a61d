"""Export writes the contract both engines load; `eyas check` rejects each violation; export → import → export is bitwise."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import zoo
from eyas.cli import app
from eyas.export.check import check_draft_dir
from eyas.families.eagle3.export import draft_config, draft_tensors
from eyas.export.files import write_draft_dir
from eyas.families.eagle3.load import import_draft_dir
from eyas.export.stage import export_run
from eyas.train.options import TrainOptions
from eyas.train.trainer import train


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    target, _, features = zoo.tiny_store(root, sizes=(("train", 12), ("holdout", 2)))
    train(TrainOptions(target=target, out=root / "run", features=features, max_steps=2, token_budget=256, ttt_steps=2,
                       checkpoint_every=2, eval_batches=1))
    result = CliRunner().invoke(app, ["export", str(root / "run"), "--out", str(root / "draft")])
    assert result.exit_code == 0 and "eyas check: ok" in result.output, result.output
    return root, target


def test_export_follows_the_contract(exported):
    root, _ = exported
    config = json.loads((root / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == 128 and config["vocab_size"] == 256
    assert config["eagle_config"] == {"use_aux_hidden_state": True}  # default ids (2, 4, 5): omitted, both engines agree
    assert "target_hidden_size" not in config
    tensors = load_file(root / "draft" / "model.safetensors")
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", *(
        f"midlayer.{n}" for n in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))}
    assert tensors["d2t"].dtype == torch.int64 and tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["fc.weight"].shape == (64, 192) and tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    ids = torch.arange(128) + tensors["d2t"]
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids[-1]) < 256
    assert "vllm serve" in (root / "draft" / "README.md").read_text()


def test_explicit_layer_ids_mean_the_same_in_both_engines(exported):
    root, _ = exported
    drafter, _ = import_draft_dir(root / "draft", target_layers=8)
    drafter.layer_ids = [1, 3, 6]
    config = draft_config(drafter, "llama", 8, "bf16")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: top level, as-is
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang adds 1 for llama targets
    with pytest.raises(Exception, match="cannot be written so that SGLang captures the same states"):
        draft_config(drafter, "deepseek_v3", 8, "bf16")  # SGLang's DeepSeek rule cannot express a first id of 1
    drafter.layer_ids = [2, 3, 6]
    assert draft_config(drafter, "deepseek_v3", 8, "bf16")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 6]
    drafter.layer_ids = [1, 2, 3]  # a 4-layer target has no default taps: its drafter's ids are written out, not refused
    assert draft_config(drafter, "llama", 4, "bf16")["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def mutate_config(change):
    def apply(directory):
        path = directory / "config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))
    return apply


def mutate_tensors(change):
    def apply(directory):
        path = directory / "model.safetensors"
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, str(path))
    return apply


VIOLATIONS = [
    ("wrong architecture", mutate_config(lambda c: c.update(architectures=["Eagle3LlamaForCausalLM"])), "architectures"),
    ("two layers", mutate_config(lambda c: c.update(num_hidden_layers=2)), "num_hidden_layers"),
    ("no draft_vocab_size", mutate_config(lambda c: c.pop("draft_vocab_size")), "draft_vocab_size is missing"),
    ("tied embeddings", mutate_config(lambda c: c.update(tie_word_embeddings=True)), "tie_word_embeddings"),
    ("missing field", mutate_config(lambda c: c.pop("hidden_size")), "hidden_size"),
    ("no aux states", mutate_config(lambda c: c.update(eagle_config={"use_aux_hidden_state": False})), "use_aux_hidden_state"),
    ("missing tensor", mutate_tensors(lambda t: t.pop("norm.weight")), "norm.weight is missing"),
    ("wrong shape", mutate_tensors(lambda t: t.update({"fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)})), "fc.weight has shape"),
    ("int d2t as int32", mutate_tensors(lambda t: t.update(d2t=t["d2t"].to(torch.int32))), "d2t is I32"),
    ("integer weight", mutate_tensors(lambda t: t.update({"norm.weight": t["norm.weight"].to(torch.int32)})), "norm.weight is I32"),
    ("d2t missing", mutate_tensors(lambda t: t.pop("d2t")), "d2t is missing (required"),
    ("d2t with a full vocabulary", mutate_config(lambda c: c.update(draft_vocab_size=256)), "lm_head.weight has shape"),
    ("no weights", lambda d: (d / "model.safetensors").unlink(), "holds no weights"),
    ("unknown tensor", mutate_tensors(lambda t: t.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)})),
     "unexpected tensor midlayer.self_attn.q_norm.weight"),
    ("unsupported variant", mutate_config(lambda c: c.update(norm_before_fc=True)), "norm_before_fc"),
    ("prefixed names", mutate_tensors(lambda t: t.update({"model.norm.weight": t.pop("norm.weight")})),
     "tensor names start with 'model.'"),
    ("unsorted ids", mutate_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[5, 2, 4],
                                                         eagle_config={"use_aux_hidden_state": True,
                                                                       "eagle_aux_hidden_state_layer_ids": [4, 1, 3]})), "not ascending"),
]


@pytest.mark.parametrize(("name", "mutate", "message"), VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_check_rejects_each_contract_violation(exported, tmp_path, name, mutate, message):
    root, _ = exported
    assert check_draft_dir(root / "draft").ok
    broken = tmp_path / "draft"
    shutil.copytree(root / "draft", broken)
    mutate(broken)
    result = check_draft_dir(broken)
    assert not result.ok, name
    assert any(message in e for e in result.errors), result.errors


def test_layer_ids_that_mean_different_states_are_an_error_given_the_target(exported, tmp_path):
    root, target = exported
    broken = tmp_path / "draft"
    shutil.copytree(root / "draft", broken)
    # Both places say [2, 4, 5]: vLLM reads input-of-layer 2,4,5; SGLang (llama target) adds 1.
    mutate_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 5],
                                     eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}))(broken)
    assert check_draft_dir(broken).ok  # without the target it cannot tell
    result = CliRunner().invoke(app, ["check", str(broken), "--target", target])
    assert result.exit_code == 1 and "SGLang captures [3, 5, 6]" in result.output


def test_export_import_export_is_bitwise_identical(exported, tmp_path):
    root, _ = exported
    drafter, tensors = import_draft_dir(root / "draft", target_layers=8)
    config = draft_config(drafter, "llama", 8, "bf16")
    again = write_draft_dir(tmp_path / "again", config, draft_tensors(tensors, config, "bf16"),
                            (root / "draft" / "README.md").read_text())
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (again / name).read_bytes() == (root / "draft" / name).read_bytes(), name


def test_export_refuses_an_untrained_run(tmp_path):
    with pytest.raises(Exception, match="train it first"):
        export_run(tmp_path / "nothing", tmp_path / "out")


def test_speculators_format_holds_the_same_drafter(exported, tmp_path):
    root, _ = exported
    path = export_run(root / "run", tmp_path / "spec", fmt="speculators")
    config = json.loads((path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["transformer_layer_config"]["hidden_size"] == 64 and config["draft_vocab_size"] == 128
    assert check_draft_dir(path).ok
    assert (path / "model.safetensors").read_bytes() == (root / "draft" / "model.safetensors").read_bytes()
    ours, _ = import_draft_dir(path, target_layers=8)
    theirs, _ = import_draft_dir(root / "draft", target_layers=8)
    assert ours == theirs
    broken = json.loads((path / "config.json").read_text())
    broken.pop("norm_before_residual")
    (path / "config.json").write_text(json.dumps(broken))
    assert any("norm_before_residual" in e for e in check_draft_dir(path).errors)
