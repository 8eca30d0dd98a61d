"""Targets a user can get wrong: no chat template, a bad --chat-template file, a garbage or truncated .gguf;
and what eyas does with a good GGUF: inspect from the header alone, one conversion per content; the export of
a Gemma-3 drafter's RoPE in the spelling both engines read.

Every bad input exits 2 with one `error:` line naming the file or option, and writes nothing.
"""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

import zoo
from eyas.cli import app
from eyas.target import gguf as gguf_module
from eyas.target.loading import resolve_target

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
runner = CliRunner()


def one_error_line(result, *names: str) -> str:
    """The run exited 2 and its last line is the one `error:` line, naming each of ``names``."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.output
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


def put(path, content: bytes):
    path.write_bytes(content)
    return path


def write_random_draft(directory, change=lambda config: None):
    """A random drafter for the tiny GGUF's vocabulary (260 tokens), exported into ``directory``."""
    from eyas.families.eagle3.export import draft_config, draft_tensors
    from eyas.export.files import write_draft_dir
    from test_drafter_consistency import random_drafter, tiny_config
    from test_import_layouts import weights

    drafter = random_drafter(tiny_config(vocab_size=260, draft_vocab_size=100))
    config = draft_config(drafter.config, "llama", zoo.LAYERS, "fp32")
    change(config)
    write_draft_dir(directory, config, draft_tensors(weights(drafter), config, "fp32"), "")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base-model target (tokenizer without a chat template, from a tiny GGUF), a template file, a drafter."""
    root = tmp_path_factory.mktemp("base")
    gguf, _ = zoo.write_tiny_gguf(root / "base.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EYAS_CACHE", str(root / "cache"))
        target = resolve_target(str(gguf))  # the converted HF directory
    (root / "chat.jinja").write_text(TEMPLATE)
    write_random_draft(root / "draft")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"What is {i} plus {i}?"}, {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n"
        for i in range(6)))
    return root, target, chats


# --------------------------------------------------------------------------- chat templates


def test_a_target_without_a_chat_template_says_to_pass_one(base, tmp_path):
    root, target, chats = base
    commands = {
        "prepare": ["prepare", "--target", target, "--data", str(chats), "--out", str(tmp_path / "data")],
        "bench": ["bench", "--target", target, "--draft", str(root / "draft"), "--out", str(tmp_path / "report"),
                  "--dataset", "mt-bench", "--prompts", "1", "--device", "cpu"],
        "generate": ["generate", "Hi", "--target", target, "--device", "cpu"],
    }
    for name, command in commands.items():
        line = one_error_line(runner.invoke(app, command), "no chat template", "--chat-template FILE")
        assert name and "Traceback" not in line
    assert list(tmp_path.iterdir()) == []  # no DATA_DIR, no REPORT_DIR


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: d / "absent.jinja", "does not exist"),
        (lambda d: d, "is a directory"),
        (lambda d: put(d / "empty.jinja", b"  \n"), "is empty"),
        (lambda d: put(d / "latin1.jinja", b"{{ caf\xe9 }}"), "is not UTF-8"),
        (lambda d: put(d / "broken.jinja", b"{% for m in messages %}{{ m['content'] }}"), "not valid Jinja"),
    ],
    ids=["missing", "directory", "empty", "not-utf8", "bad-jinja"],
)
def test_an_unusable_chat_template_file_is_one_line(base, tmp_path, make, says):
    root, target, chats = base
    files = tmp_path / "files"
    files.mkdir()
    template = make(files)
    out = tmp_path / "out"
    flags = ["--chat-template", str(template)]
    for command in (["prepare", "--target", target, "--data", str(chats), "--out", str(out / "data"), *flags],
                    ["generate", "Hi", "--target", target, "--device", "cpu", "--max-new-tokens", "2", *flags]):
        one_error_line(runner.invoke(app, command), f"--chat-template {template}", says)
    assert not out.exists()


def test_a_template_file_renders_prepare_bench_and_generate_for_a_base_model(base, tmp_path):
    from eyas.data.benchmarks import load_prompts
    from eyas.data.samples import read_samples
    from eyas.target.loading import load_tokenizer

    root, target, chats = base
    template = ["--chat-template", str(root / "chat.jinja")]
    prepared = runner.invoke(app, ["prepare", "--target", target, "--data", str(chats), "--out", str(tmp_path / "data"),
                                   "--holdout", "0", "--draft-vocab-size", "50", *template])
    assert prepared.exit_code == 0, prepared.output
    tokenizer = load_tokenizer(target)
    sample = read_samples(tmp_path / "data" / "train.parquet")[0]
    assert tokenizer.decode(sample.input_ids[sample.loss_mask.astype(bool)]).endswith("<|im_end|>")  # the template's turn end

    prompts, _ = load_prompts(["mt-bench"], tokenizer, None, 1, 1024, (root / "chat.jinja").read_text())
    text = tokenizer.decode(prompts[0].input_ids)
    assert text.startswith("<|endoftext|><|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    report = tmp_path / "report"
    benched = runner.invoke(app, ["bench", "--target", target, "--draft", str(root / "draft"), "--out", str(report),
                                  "--dataset", "mt-bench", "--prompts", "1", "--mode", "chain:2", "--max-new-tokens", "4",
                                  "--device", "cpu", "--temperature", "0", *template])
    assert benched.exit_code == 0, benched.output
    assert [row["prompts"] for row in json.loads((report / "report.json").read_text())["rows"]] == [1]

    generated = runner.invoke(app, ["generate", "Name a colour.", "--target", target, "--draft", str(root / "draft"),
                                    "--mode", "chain:2", "--max-new-tokens", "4", "--device", "cpu", "--json", *template])
    assert generated.exit_code == 0, generated.output
    answer = json.loads(generated.stdout.strip().splitlines()[-1])
    assert 0 < len(answer["token_ids"]) <= 4 and answer["tau"] >= 1.0


# --------------------------------------------------------------------------- GGUF files


def _truncated_header(d):
    path, _ = zoo.write_tiny_gguf(d / "whole.gguf")
    (d / "cut.gguf").write_bytes(path.read_bytes()[:100])
    return d / "cut.gguf"


def _truncated_data(d):
    path, _ = zoo.write_tiny_gguf(d / "whole.gguf")
    data = path.read_bytes()
    (d / "cut.gguf").write_bytes(data[: len(data) // 2])
    return d / "cut.gguf"


GARBAGE = {
    "text": (lambda d: put(d / "m.gguf", b"<html>404 Not Found</html>"), "GGUF magic bytes"),
    "empty": (lambda d: put(d / "m.gguf", b""), "GGUF magic bytes"),
    "version": (lambda d: put(d / "m.gguf", b"GGUF" + (99).to_bytes(4, "little") + bytes(16)), "GGUF version 99"),
    "cut-header": (_truncated_header, "cut short or corrupt"),
    "cut-data": (_truncated_data, "is truncated"),
}


@pytest.mark.parametrize(("make", "says"), GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_gguf_is_one_line_naming_the_file_in_inspect_and_the_stages(tmp_path, monkeypatch, make, says):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    files = tmp_path / "files"
    files.mkdir()
    bad = str(make(files))
    one_error_line(runner.invoke(app, ["inspect", bad]), bad, says)
    data = zoo.write_data_dir(tmp_path / "data", sizes=(("train", 2), ("holdout", 1)))
    before = sorted(p.name for p in (tmp_path / "data").iterdir())
    for command in (["prepare", "--target", bad, "--data", str(files / "none.jsonl"), "--out", str(tmp_path / "d")],
                    ["capture", "--target", bad, "--data", data, "--out", str(tmp_path / "f")],
                    ["generate", "Hi", "--target", bad]):
        one_error_line(runner.invoke(app, command), bad, says)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "d").exists() and not (tmp_path / "f").exists()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == before


def test_inspect_reads_a_gguf_header_and_writes_nothing(tmp_path, monkeypatch):
    from eyas.target.describe import describe_target

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    gguf, model = zoo.write_tiny_gguf(tmp_path / "models" / "chat.gguf", chat_template=TEMPLATE)
    monkeypatch.setattr(gguf_module, "_convert", lambda *a: pytest.fail("inspect converted the GGUF"))
    result = runner.invoke(app, ["inspect", str(gguf), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert not (tmp_path / "cache").exists() and [p.name for p in (tmp_path / "models").iterdir()] == ["chat.gguf"]
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (zoo.LAYERS, 64, 260)
    assert info["parameters"] == sum(p.numel() for p in model.parameters()) and info["chat_template"] is True
    assert info["source"] == str(gguf)
    monkeypatch.undo()  # the same facts as the converted target's
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    converted = describe_target(resolve_target(str(gguf))).to_dict()
    assert {k: v for k, v in info.items() if k not in ("spec", "source")} == {
        k: v for k, v in converted.items() if k not in ("spec", "source")}


def test_the_same_gguf_at_two_paths_converts_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    first, _ = zoo.write_tiny_gguf(tmp_path / "venv1" / "model.gguf")
    second = tmp_path / "venv2" / "renamed.gguf"
    second.parent.mkdir()
    shutil.copy(first, second)
    conversions, hashes = [], []
    convert, sha = gguf_module._convert, gguf_module.file_sha256
    monkeypatch.setattr(gguf_module, "_convert", lambda *a: conversions.append(a[0]) or convert(*a))
    monkeypatch.setattr(gguf_module, "file_sha256", lambda p: hashes.append(p) or sha(p))
    one = resolve_target(str(first))
    assert resolve_target(str(second)) == one and resolve_target(str(first)) == one
    assert conversions == [first] and len(hashes) == 2  # each path hashed once, then remembered
    index = json.loads((tmp_path / "cache" / "gguf" / "index.json").read_text())
    assert {entry["sha256"] for entry in index.values()} == {sha(first)} and len(index) == 2
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == ["index.json", f"model-{sha(first)[:16]}"]
    second.touch()  # a new mtime: hashed again, still the same conversion
    assert resolve_target(str(second)) == one and len(hashes) == 3 and len(conversions) == 1
    zoo.write_tiny_gguf(first, chat_template=TEMPLATE)  # other bytes at the first path: a conversion of their own
    assert resolve_target(str(first)) != one and len(conversions) == 2


def test_an_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    gguf, _ = zoo.write_tiny_gguf(tmp_path / "model.gguf")
    convert = gguf_module._convert

    def full_disk(source, out):
        (out / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_module, "_convert", full_disk)
    with pytest.raises(OSError, match="No space left"):
        resolve_target(str(gguf))
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == ["index.json"]  # no partial, no temporary dir
    monkeypatch.setattr(gguf_module, "_convert", convert)
    assert (gguf_module.Path(resolve_target(str(gguf))) / "model.safetensors").is_file()


# --------------------------------------------------------------------------- Gemma-3 export


def test_gemma3_drafter_exports_the_rope_it_was_trained_with_flat(tmp_path):
    """Gemma 3 has one RoPE per layer type (sliding θ 1e4, full 1e6). The drafter's layer is full attention: it
    trains with θ 1e6, and config.json says so flat — rope_theta, and a rope_parameters SGLang reads (its θ, and
    as rope_scaling, every value hashed) and transformers (vLLM) standardizes to the same RoPE."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from eyas.train.options import TrainOptions
    from eyas.train.trainer import train

    target = tmp_path / "gemma"
    gemma = zoo.gemma3_text()
    assert gemma.config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    gemma.save_pretrained(target)
    data = zoo.write_data_dir(tmp_path / "data", sizes=(("train", 4), ("holdout", 1)))
    train(TrainOptions(target=str(target), out=tmp_path / "run", data=tmp_path / "data", online=True, max_steps=1,
                       token_budget=128, ttt_steps=1, checkpoint_every=1, eval_batches=1))
    assert data and runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "draft")]).exit_code == 0
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert "rope_scaling" not in config and not any(isinstance(v, dict) for v in config["rope_parameters"].values())
    hash(tuple(config["rope_parameters"].items()))  # SGLang and vLLM key their RoPE caches on these items

    from eyas.families.eagle3.load import load_drafter

    drafter = load_drafter(tmp_path / "draft", gemma.get_input_embeddings().weight, zoo.LAYERS)
    engine_reads = LlamaRotaryEmbedding(LlamaConfig.from_dict(config)).inv_freq
    assert torch.equal(engine_reads, drafter.rotary.inv_freq)
    trained = json.loads((tmp_path / "run" / "drafter_config.json").read_text())["rope_parameters"]
    assert trained == config["rope_parameters"]


def test_a_drafter_config_from_earlier_eyas_exports_the_theta_it_trained_with():
    from eyas.families.eagle3.export import draft_config
    from test_drafter_consistency import tiny_config

    earlier = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
               "full_attention": {"rope_type": "default", "rope_theta": 1e6}, "rope_type": "default", "rope_theta": 1e4}
    config = draft_config(tiny_config(rope_parameters=earlier), "gemma3_text", zoo.LAYERS, "fp32")
    assert config["rope_theta"] == 1e4 and config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4}


def test_eyas_run_renders_benchmark_prompts_with_prepare_s_chat_template(tmp_path):
    from eyas.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('target = "base.gguf"\nworkdir = "w"\n[prepare]\ndata = ["chats.jsonl"]\nchat_template = "chat.jinja"\n')
    assert str(load_config(path).options("bench").chat_template) == "chat.jinja"
    assert str(load_config(path, ["bench.chat_template=other.jinja"]).options("bench").chat_template) == "other.jinja"
    path.write_text('target = "demo"\nworkdir = "w"\n')
    assert load_config(path).options("bench").chat_template is None


def test_check_refuses_a_drafter_whose_rope_is_nested_per_layer_type(tmp_path):
    gemma_rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}}  # Gemma 3's, copied as is
    write_random_draft(tmp_path / "draft", lambda config: config.update(rope_parameters=gemma_rope))
    result = runner.invoke(app, ["check", str(tmp_path / "draft")])
    assert result.exit_code == 1 and "error: rope_parameters is nested" in result.output, result.output
