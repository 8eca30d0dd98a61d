"""Inputs that do not belong together: a DATA_DIR tokenized for another target, a store or a drafter made from a
target that differs only inside its decoder layers. Each stage that is handed them refuses in one `error:` line
naming the file and what to do, before it writes anything (a drafter for a sibling target decodes losslessly: bench,
generate and check warn)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import zoo
from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.cli import app
from eyas.export.stage import export_run
from eyas.manifest import write_manifest
from eyas.target.fingerprint import group_of, sample_digests, sample_mismatch
from eyas.target.loading import resolve_target
from eyas.train.options import TrainOptions
from eyas.train.trainer import train
from test_bad_input_reads import error_line as one_error_line

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def error_line(result, *names) -> str:
    """Exit 2, one `error:` line naming each of ``names``, no traceback."""
    assert result.exit_code == 2, result.output
    return one_error_line(result, *names)


def merged_adapter(target: str, directory: Path, layer: int = 1) -> str:
    """``target`` with one middle layer's MLP changed everywhere, as merging a LoRA into it would: the embedding,
    lm_head, final norm and config.json are the target's."""
    shutil.copytree(target, directory)
    weights = load_file(directory / "model.safetensors")
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.01 * torch.randn_like(weights[name])
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return str(directory)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """A tiny target with its DATA_DIR, store, run and drafter; the target with a merged adapter in layer 1; its twin
    (same config, other weights); a target whose vocabulary is smaller than the DATA_DIR's ids."""
    root = tmp_path_factory.mktemp("belong")
    target = zoo.save_tiny_target(root / "target")
    data = Path(zoo.write_data_dir(root / "data", sizes=(("train", 8), ("holdout", 2))))
    write_manifest(data, "prepare", {}, [], ["train.parquet", "holdout.parquet", "vocab.safetensors"])
    capture(CaptureOptions(target=target, data=data, out=root / "features", dtype="fp32", token_budget=200, max_batch=4))
    train(TrainOptions(target=target, out=root / "run", features=root / "features", max_steps=1, token_budget=256,
                       ttt_steps=1, checkpoint_every=1, eval_batches=1))
    export_run(root / "run", root / "draft", dtype="fp32")
    return {"target": target, "data": data, "features": root / "features", "draft": root / "draft",
            "merged": merged_adapter(target, root / "merged"), "twin": zoo.save_llama(root / "twin", seed=1),
            "narrow": zoo.save_llama(root / "narrow", vocab_size=64)}


# A store or a drafter from a target that differs inside its decoder layers


def test_the_sampled_fingerprint_names_the_layer_a_merged_adapter_changed(made, tmp_path):
    files = lambda spec: [Path(spec) / "model.safetensors"]  # noqa: E731
    same = sample_digests(files(made["target"]))
    assert sample_mismatch(same, sample_digests(files(shutil.copytree(made["target"], tmp_path / "moved")))) is None
    assert sample_mismatch(same, sample_digests(files(made["merged"]))) == "decoder layer 1"
    assert sample_mismatch(same, sample_digests(files(made["twin"]))) == \
        f"{zoo.LAYERS} decoder layers (0, 1, 2, 3, 4, 5, …) and tensors outside the decoder layers"
    assert group_of("model.language_model.layers.12.mlp.experts.3.w1.weight") == "layer 12"
    assert group_of("lm_head.weight") == group_of("model.norm.weight") == "other"


def test_train_refuses_a_store_captured_from_a_target_with_other_middle_layers(made, tmp_path):
    args = ["train", "--target", made["merged"], "--features", made["features"], "--out", tmp_path / "run",
            "--max-steps", "1", "--token-budget", "256", "--ttt-steps", "1", "--eval-batches", "1"]
    error_line(run(*args), made["features"] / "manifest.json", made["merged"], "other weights in decoder layer 1",
               "--no-verify")
    assert not (tmp_path / "run").exists()


def test_a_resume_against_a_target_with_other_middle_layers_is_refused(made, tmp_path):
    run_dir = shutil.copytree(made["features"].parent / "run", tmp_path / "run")
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    args = ["train", "--target", made["merged"], "--features", made["features"], "--out", run_dir, "--resume",
            "--max-steps", "2", "--token-budget", "256", "--ttt-steps", "1", "--eval-batches", "1", "--no-verify"]
    result = run(*args[:-1])  # with verification: the store refuses the target first
    error_line(result, "decoder layer 1")
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize(("other", "says"), [("merged", "other weights in decoder layer 1"),
                                             ("twin", "the embedding, lm_head or final norm differ")])
def test_check_and_bench_warn_of_a_drafter_trained_against_a_sibling_target(made, other, says):
    result = run("check", made["draft"], "--target", made[other])
    assert result.exit_code == 0, result.output  # it fits the target's shape: it decodes, losslessly
    warned = [line for line in result.output.splitlines() if "warning" in line]
    assert len(warned) == 1 and says in warned[0] and str(made["draft"] / "manifest.json") in warned[0], result.output

    from eyas.export.fit import weights_warning

    assert weights_warning(made["draft"], made["target"]) is None
    assert says in weights_warning(made["draft"], made[other])


def test_bench_prints_the_warning_before_it_loads_the_target(made, monkeypatch, capsys):
    import eyas.target.loading
    from eyas.export.fit import require_fit

    monkeypatch.setattr(eyas.target.loading, "load_target", lambda *a, **k: pytest.fail("loaded"))
    require_fit(made["draft"], made["merged"])
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "decoder layer 1" in err
    require_fit(made["draft"], made["target"])
    assert capsys.readouterr().err == ""


# A DATA_DIR whose ids fall outside the target's vocabulary


def test_every_stage_refuses_a_data_dir_whose_ids_are_outside_the_vocabulary(made, tmp_path):
    narrow, data = made["narrow"], made["data"]
    commands = {
        "capture": ["capture", "--target", narrow, "--data", data, "--out", tmp_path / "out", "--dtype", "fp32"],
        "train": ["train", "--target", narrow, "--data", data, "--online", "--out", tmp_path / "out", "--max-steps", "1"],
        "bench": ["bench", "--target", narrow, "--draft", made["draft"], "--data", data, "--dataset", "sharegpt-holdout", "--out",
                  tmp_path / "out", "--max-new-tokens", "2", "--device", "cpu"],
    }
    for name, args in commands.items():
        line = error_line(run(*args), "outside the 64 ids", "prepared for another tokenizer", "eyas prepare --target")
        assert ".parquet: sample " in line, (name, line)
        assert not (tmp_path / "out").exists(), name


# A DATA_DIR tokenized by another tokenizer whose ids happen to fit


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory) -> dict:
    """A DATA_DIR prepared for a tiny GGUF target (a byte-level tokenizer of 259 tokens) and a target of the demo's
    tokenizer (49,152 tokens): every id of the first fits the second's vocabulary, and means other text there."""
    root = tmp_path_factory.mktemp("tokenizers")
    gguf, _ = zoo.write_tiny_gguf(root / "bytes.gguf", chat_template=TEMPLATE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EYAS_CACHE", str(root / "cache"))
        small = resolve_target(str(gguf))
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"What is {i} plus {i}?"}, {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n"
        for i in range(12)))
    result = run("prepare", "--target", small, "--data", chats, "--out", root / "data", "--holdout", "0.25")
    assert result.exit_code == 0, result.output
    return {"small": small, "data": root / "data", "chat": str(zoo.save_chat_target(root / "chat"))}


def test_every_stage_refuses_a_data_dir_of_another_tokenizer_even_when_its_ids_fit(two_tokenizers, made, tmp_path):
    chat, data = two_tokenizers["chat"], two_tokenizers["data"]
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokenizer_vocab_sha256"] and manifest["vocab_size"] < 49152  # the ids fit: only the tokenizer tells
    commands = {
        "capture": ["capture", "--target", chat, "--data", data, "--out", tmp_path / "out", "--dtype", "fp32"],
        "train": ["train", "--target", chat, "--data", data, "--online", "--out", tmp_path / "out", "--max-steps", "1"],
        "bench": ["bench", "--target", chat, "--draft", made["draft"], "--data", data, "--dataset", "sharegpt-holdout",
                  "--out", tmp_path / "out", "--max-new-tokens", "2", "--device", "cpu"],
    }
    for name, args in commands.items():
        error_line(run(*args), data / "manifest.json", "another tokenizer", "their vocabularies differ",
                   f"eyas prepare --target {chat}")
        assert not (tmp_path / "out").exists(), name


def test_a_data_dir_of_an_older_eyas_is_compared_by_its_tokenizer_sha256(two_tokenizers, tmp_path):
    data = Path(shutil.copytree(two_tokenizers["data"], tmp_path / "data"))
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["tokenizer_vocab_sha256"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    from eyas.data.fits_target import require_data_fits
    from eyas.errors import EyasError

    require_data_fits(data, two_tokenizers["small"])  # its own target: no complaint
    with pytest.raises(EyasError, match="serializations' SHA-256 differ"):
        require_data_fits(data, two_tokenizers["chat"])
