"""`eyas bench` end to end on a tiny target, its prompt sources, and `eyas generate`."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import zoo
from eyas.cli import app
from eyas.data.benchmarks import holdout_prompts, humaneval_problems, load_prompts, mt_bench_questions, render
from eyas.data.samples import Sample, read_samples, write_samples
from eyas.engine.modes import parse_mode, parse_modes
from eyas.errors import EyasError
from eyas.families.eagle3.export import draft_config, draft_tensors
from eyas.export.files import write_draft_dir
from test_import_layouts import weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_drafter_consistency import random_drafter, tiny_config

    root = tmp_path_factory.mktemp("bench")
    target = zoo.save_tiny_target(root / "target")
    data = root / "data"
    zoo.write_data_dir(data, sizes=(("train", 6), ("holdout", 4)))
    drafter = random_drafter(tiny_config(vocab_size=256, draft_vocab_size=100))
    config = draft_config(drafter.config, "llama", zoo.LAYERS, "fp32")
    write_draft_dir(root / "draft", config, draft_tensors(weights(drafter), config, "fp32"), "")
    return root, target, data


def test_bench_reports_tau_speed_and_losslessness(setup, monkeypatch):
    import eyas.engine.loading

    root, target, data = setup
    capacities = []
    load = eyas.engine.loading.load_engine
    monkeypatch.setattr(eyas.engine.loading, "load_engine", lambda *a, **k: capacities.append(a[2]) or load(*a, **k))
    result = CliRunner().invoke(app, ["bench", "--target", target, "--draft", str(root / "draft"), "--out", str(root / "report"),
                                      "--dataset", "sharegpt-holdout", "--data", str(data), "--mode", "chain:3,tree:8,3,3",
                                      "--max-new-tokens", "12", "--device", "cpu", "--dtype", "fp32", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads((root / "report" / "report.json").read_text())
    assert report["settings"]["repeats"] == 2
    # by default T = 0 and T = 1 side by side, each mode beside its own temperature's plain run; at T = 1 a chain's
    # drafts are drawn from the drafter (auto), and so are a tree's children (auto: from T = 0.85)
    assert report["settings"]["temperature"] == [0.0, 1.0]
    modes = {(row["mode"], row["temperature"]): row for row in report["rows"]}
    assert list(modes) == [("chain:3", 0.0), ("tree:8,3,3", 0.0), ("chain:3 drawn", 1.0), ("tree:8,3,3 drawn", 1.0)]
    plain = {r["temperature"]: r for r in report["datasets"]["sharegpt-holdout"] if r["mode"] == "plain"}
    count = len(holdout_prompts(data))  # holdout conversations with a prompt before their first assistant token
    for (_, temperature), row in modes.items():
        assert row["dataset"] == "sharegpt-holdout" and row["prompts"] == count > 0
        assert row["tau"] >= 1.0 and row["tokens_per_second"] > 0
        assert row["plain_tokens_per_second"] == plain[temperature]["tokens_per_second"] > 0
        assert len(row["accepted_per_position"]) == 3
        if temperature == 0:
            assert row["matches_plain"] == count  # greedy speculative == greedy plain, every prompt
            low, high = row["speedup_range"]  # the prompts' own speedups; outputs equal, so the pooled one is between
            assert 0 < low <= row["speedup"] <= high
        else:
            assert row["matches_plain"] is None  # sampled answers are not compared token for token
    assert (root / "report" / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (root / "report" / "report.md").read_text()
    assert f"| sharegpt-holdout | 0 | chain:3 | {count} |" in text and f"| sharegpt-holdout | 1 | chain:3 drawn | {count} |" in text
    low, high = modes["chain:3", 0.0]["speedup_range"]
    assert f"× ({low:.2f}–{high:.2f} over {count} prompts) |" in text
    # caches sized to the longest benchmarked prompt + new tokens + the largest round's drafts + 1
    assert capacities == [max(len(p.input_ids) for p in holdout_prompts(data)) + 12 + 8 + 1]


def test_training_prompts_are_never_benchmark_prompts(setup, tmp_path):
    root, _, data = setup
    first = holdout_prompts(data)[0].id
    leaked = next(s for s in read_samples(data / "holdout.parquet") if s.id == first)
    train = read_samples(data / "train.parquet") + [Sample("leak", leaked.input_ids, leaked.loss_mask)]
    copy = tmp_path / "data"
    copy.mkdir()
    write_samples(train, copy / "train.parquet")
    write_samples(read_samples(data / "holdout.parquet"), copy / "holdout.parquet")
    prompts, dropped = load_prompts(["sharegpt-holdout"], None, copy, None, 1024)
    assert dropped["also a training prompt"] == 1 and len(prompts) == len(holdout_prompts(data)) - 1


def test_prompt_sources_and_the_chat_template():
    from eyas.target.loading import load_tokenizer, resolve_target

    questions, problems = mt_bench_questions(), humaneval_problems()
    assert len(questions) == 80 and len(problems) == 164
    assert problems[0][0] == "HumanEval/0" and "def has_close_elements" in problems[0][1]
    tokenizer = load_tokenizer(resolve_target("demo"))
    ids = render(tokenizer, questions[0][1])
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and questions[0][1] in text


def test_modes_parse_or_explain():
    assert parse_mode("chain:5").draft_length == 5
    tree = parse_mode("tree:60,7,10")
    assert (tree.total, tree.depth, tree.top_k) == (60, 7, 10)
    assert [m.label() for m in parse_modes("chain:5,tree:60,7,10")] == ["chain:5", "tree:60,7,10"]
    for bad in ("chain", "tree:60,7", "beam:3", "chain:x"):
        with pytest.raises(EyasError, match="chain:K"):
            parse_mode(bad)


def test_generate_streams_the_same_tokens_with_and_without_a_drafter(setup):
    root, target, _ = setup
    # the tiny target has no tokenizer: give generate a prompt through a DATA_DIR-free path by using ids directly
    from eyas.engine.decode import generate
    from eyas.speculation import Tree
    from eyas.engine.loading import load_engine, prompt_tensor

    engine = load_engine(target, root / "draft", 128, "cpu", dtype="fp32")
    streamed: list[int] = []
    ids = prompt_tensor(list(np.arange(1, 11)))
    with_draft = generate(engine.target_runner, ids, 16, engine.draft_runner, Tree(top_k=3, depth=3, total=8),
                          on_tokens=streamed.extend)
    alone = generate(engine.target_runner, ids, 16)
    assert streamed == with_draft.tokens == alone.tokens


def test_generate_command_streams_an_answer_and_explains_a_missing_tokenizer(setup):
    _, target, _ = setup
    result = CliRunner().invoke(app, ["generate", "Name a colour.", "--target", "demo", "--max-new-tokens", "6",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "no drafter," in result.output and "tok/s" in result.output
    answer = result.output.split("no drafter,")[0]
    assert len(answer.strip()) > 0
    refused = CliRunner().invoke(app, ["generate", "Hi", "--target", target, "--device", "cpu"])
    assert refused.exit_code == 2 and "has no tokenizer" in refused.output


def test_generate_json_gives_ids_text_and_with_a_drafter_tau_and_rounds(tmp_path):
    """DESIGN's `generate --json`: one JSON object; a random drafter changes nothing in the greedy answer."""
    import json

    from test_drafter_consistency import random_drafter, tiny_config

    drafter = random_drafter(tiny_config(hidden_size=576, target_hidden_size=576, num_attention_heads=9,
                                         num_key_value_heads=3, head_dim=64, intermediate_size=256, vocab_size=49152,
                                         draft_vocab_size=200, layer_ids=[2, 15, 27]))
    config = draft_config(drafter.config, "llama", 30, "fp32")
    write_draft_dir(tmp_path / "draft", config, draft_tensors(weights(drafter), config, "fp32"), "")
    common = ["generate", "Name a colour.", "--target", "demo", "--max-new-tokens", "6", "--device", "cpu", "--dtype", "fp32",
              "--json"]
    alone = CliRunner().invoke(app, common)
    speculated = CliRunner().invoke(app, [*common, "--draft", str(tmp_path / "draft"), "--mode", "chain:2"])
    assert alone.exit_code == 0 and speculated.exit_code == 0, alone.output + speculated.output
    plain, spec = json.loads(alone.stdout.strip().splitlines()[-1]), json.loads(speculated.stdout.strip().splitlines()[-1])
    assert set(plain) == {"token_ids", "text"} and set(spec) == {"token_ids", "text", "tau", "rounds"}
    assert 0 < len(plain["token_ids"]) <= 6 and plain["text"].strip()
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["tau"] >= 1.0 and spec["rounds"] >= 1


@pytest.mark.parametrize(("device", "native", "expected"), [
    ("cuda", False, torch.bfloat16), ("cpu", True, torch.bfloat16), ("cpu", False, torch.float32)])
def test_auto_decodes_in_bf16_on_cuda_and_on_a_cpu_with_native_bf16_else_fp32(monkeypatch, device, native, expected):
    import eyas.engine.loading as loading

    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: native)
    assert loading.decoding_dtype(device) == loading.decoding_dtype(device, "auto") == expected
    assert loading.decoding_dtype(device, "fp32") == torch.float32 and loading.decoding_dtype(device, "bf16") == torch.bfloat16


@pytest.mark.parametrize(("flags", "native"), [({"avx512_bf16": True}, True), ({"amx_bf16": True, "avx512_bf16": False}, True),
                                               ({"avx512_f": True, "avx2": True}, False), ({}, False)])
def test_native_bf16_means_avx512_bf16_or_amx(monkeypatch, flags, native):
    import eyas.engine.loading as loading

    monkeypatch.setattr(loading, "cpu_capabilities", lambda: flags)
    assert loading.cpu_has_native_bf16() is native


def test_cpuinfo_flags_stand_in_for_a_torch_without_get_capabilities(monkeypatch, tmp_path):
    import eyas.engine.loading as loading

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert loading.cpu_capabilities(cpuinfo) == {"fpu": True, "avx2": True, "avx512f": True, "avx512_bf16": True}
    assert loading.cpu_capabilities(tmp_path / "absent") == {}


@pytest.mark.parametrize(("flag", "native", "dtype"), [("bf16", False, "bfloat16"), ("fp32", True, "float32"),
                                                       ("auto", True, "bfloat16"), ("auto", False, "float32")])
def test_dtype_option_is_what_the_bench_decodes_in_and_its_report_says(setup, monkeypatch, tmp_path, flag, native, dtype):
    import eyas.engine.loading as loading

    root, target, data = setup
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: native)
    result = CliRunner().invoke(app, ["bench", "--target", target, "--draft", str(root / "draft"), "--out", str(tmp_path / "r"),
                                      "--dataset", "sharegpt-holdout", "--data", str(data), "--prompts", "1", "--mode",
                                      "chain:2", "--max-new-tokens", "4", "--device", "cpu", "--temperature", "0",
                                      "--dtype", flag])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r" / "report.json").read_text())["settings"]["dtype"] == dtype
    text = (tmp_path / "r" / "report.md").read_text()
    assert f"- dtype: {dtype}" in text
    # in bf16 a greedy answer that parts from plain decoding's is rounding, and the report says so beside the count
    assert ("equality is guaranteed in float32" in text) == (dtype == "bfloat16")


def test_generate_loads_the_target_in_the_dtype_asked(monkeypatch):
    import eyas.target.loading

    asked = []

    def load_target(*args, dtype=None, **kwargs):
        asked.append(dtype)
        raise EyasError("loaded far enough")

    monkeypatch.setattr(eyas.target.loading, "load_target", load_target)
    for flag in ("bf16", "fp32"):
        result = CliRunner().invoke(app, ["generate", "Hi", "--target", "demo", "--device", "cpu", "--dtype", flag])
        assert "loaded far enough" in result.output
    assert asked == [torch.bfloat16, torch.float32]


def test_held_out_conversations_without_a_prompt_are_counted_as_dropped(tmp_path):
    """A held-out conversation whose first token is already an answer's gives no prompt: it is counted, not lost."""
    from pathlib import Path

    from eyas.data.benchmarks import NO_PROMPT
    from eyas.data.samples import read_samples

    data = Path(zoo.write_data_dir(tmp_path / "data", sizes=(("train", 4), ("holdout", 8))))
    samples = read_samples(data / "holdout.parquet")
    opening = sum(1 for s in samples if s.loss_mask[0] == 1 or not s.loss_mask.any())
    dropped: dict[str, int] = {}
    prompts = holdout_prompts(data, dropped)
    assert len(prompts) + dropped[NO_PROMPT] == len(samples) and dropped[NO_PROMPT] == opening > 0


def test_samples_pool_each_prompts_draws_at_consecutive_seeds_and_count_the_prompt_once():
    """bench --samples 2 at T = 1: each decoder's τ is its two seeds' rounds pooled, the same as decoding seed 0 and
    seed 1 one after the other; greedy decoders run once; a prompt is still one prompt."""
    from eyas.bench.run import run_bench
    from eyas.data.benchmarks import Prompt
    from eyas.engine.decode import generate
    from eyas.engine.target_runner import TargetRunner
    from eyas.families.eagle3.runner import DraftRunner
    from eyas.speculation import Chain, Sampling
    from test_engine_greedy import constant_pair, prompt_of

    model, layout, drafter = constant_pair()
    prompts = [Prompt("d", str(seed), prompt_of(seed).tolist()[0]) for seed in (1, 2)]
    target, draft = TargetRunner(model, layout, None, 80), DraftRunner(drafter, 96)
    result = run_bench(target, draft, prompts, [Chain(3)], [Sampling(), Sampling(1.0, seed=7)], 30, set(), samples=2)
    rows = {(r.mode, r.temperature): r for r in result.datasets["d"]}
    assert result.settings["samples"] == 2 and all(r.prompts == 2 for r in rows.values())
    rounds = accepted = 0
    for prompt in prompts:
        for seed in (7, 8):
            g = generate(target, torch.tensor([prompt.input_ids]), 30, draft, Chain(3), Sampling(1.0, seed=seed))
            rounds, accepted = rounds + g.rounds, accepted + sum(g.accepted)
    drawn = rows[("chain:3 drawn", 1.0)]
    assert (drawn.rounds, drawn.accepted) == (rounds, accepted)
    assert len(drawn.outputs) == len(drawn.prompt_rates) == 2  # a prompt's first seed's: what engines compare with
    assert len(rows[("chain:3", 0.0)].outputs) == 2 and rows[("chain:3", 0.0)].matches_plain == 2


def long_holdout(directory):
    """A DATA_DIR whose held-out conversations have histories of 250, 1,400 and 2,900 tokens before their last answer
    (a second answer set of the first, and two with no prompt before an answer), as `eyas prepare` writes them."""
    from pathlib import Path

    from eyas.data.vocab import build_draft_vocab, save_vocab

    directory = Path(directory)
    rng = np.random.default_rng(0)

    def sample(sample_id, runs):  # runs: (prompt tokens, answer tokens), … in order
        mask = np.concatenate([np.r_[np.zeros(p, np.uint8), np.ones(a, np.uint8)] for p, a in runs])
        return Sample(sample_id, rng.integers(1, zoo.VOCAB, size=len(mask)).astype(np.int32), mask)

    held = [sample("short", [(100, 50), (100, 40)]), sample("short#2", [(100, 60), (100, 40)]),
            sample("mid", [(600, 400), (400, 30)]), sample("long", [(1000, 900), (1000, 20)]),
            sample("none", [(0, 30)]), sample("silent", [(40, 0)])]
    write_samples(held, directory / "holdout.parquet")
    write_samples([sample("train-0", [(10, 10)])], directory / "train.parquet")
    save_vocab(build_draft_vocab(np.ones(zoo.VOCAB, np.int64), 100), directory / "vocab.safetensors")
    (directory / "manifest.json").write_text(json.dumps({"format": "eyas-data/1"}))
    return directory


def test_long_prompts_are_each_conversations_history_by_length_bucket(tmp_path):
    """sharegpt-long: each held-out conversation once, its prompt everything before its last answer, labelled by the
    bucket that holds its length, buckets in order of length; --prompts counts per bucket; prompts longer than the
    target's window leaves room for are dropped under their own reason, those with no prompt before an answer too."""
    from eyas.data.benchmarks import NO_PROMPT, TOO_LONG_FOR_WINDOW, length_bucket

    data = long_holdout(tmp_path / "data")
    samples = {s.id: s for s in read_samples(data / "holdout.parquet")}
    prompts, dropped = load_prompts(["sharegpt-long"], None, data, None, 1024, long_prompt_tokens=2000)
    assert [(p.dataset, p.id, len(p.input_ids)) for p in prompts] == [("sharegpt-long:1k", "short", 250),
                                                                     ("sharegpt-long:2k", "mid", 1400)]
    assert prompts[1].input_ids == samples["mid"].input_ids[:1400].tolist()
    assert dropped[TOO_LONG_FOR_WINDOW] == 1 and dropped[NO_PROMPT] == 2 and dropped["longer than max prompt tokens"] == 0
    everything, _ = load_prompts(["sharegpt-long", "sharegpt-holdout"], None, data, 1, 1024, long_prompt_tokens=4000)
    assert [p.dataset for p in everything] == ["sharegpt-long:1k", "sharegpt-long:2k", "sharegpt-long:4k",
                                               "sharegpt-holdout"]  # --prompts 1: one a bucket
    assert [length_bucket(n) for n in (1, 1024, 1025, 2048, 2049, 8192, 8193)] == [
        "sharegpt-long:1k", "sharegpt-long:1k", "sharegpt-long:2k", "sharegpt-long:2k", "sharegpt-long:4k",
        "sharegpt-long:8k", "sharegpt-long:16k"]


def test_bench_reports_each_length_bucket_of_long_prompts(setup, tmp_path, monkeypatch):
    """eyas bench --dataset sharegpt-long on a target with a 4,096-token window: a row per length bucket, greedy
    speculation equal to plain decoding in each, each bucket decoded over a cache of its own lengths (the other
    datasets sharing one); with answers too long for the longest history to fit, the window's bound is said in one
    line."""
    import eyas.engine.loading

    root, _, _ = setup
    target = zoo.save_llama(tmp_path / "target", max_position_embeddings=4096)
    data = long_holdout(tmp_path / "data")
    capacities = []
    load = eyas.engine.loading.load_engine
    monkeypatch.setattr(eyas.engine.loading, "load_engine", lambda *a, **k: capacities.append(a[2]) or load(*a, **k))

    def bench(new_tokens, datasets="sharegpt-long"):
        return CliRunner().invoke(app, ["bench", "--target", target, "--draft", str(root / "draft"), "--out",
                                        str(tmp_path / f"report-{new_tokens}"), "--dataset", datasets, "--data",
                                        str(data), "--mode", "chain:3", "--max-new-tokens", str(new_tokens),
                                        "--temperature", "0", "--device", "cpu", "--dtype", "fp32"])

    result = bench(6, "sharegpt-holdout,sharegpt-long")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "report-6" / "report.json").read_text())["rows"]
    assert [(r["dataset"], r["prompts"], r["matches_plain"]) for r in rows] == [
        ("sharegpt-holdout", 3, 3), ("sharegpt-long:1k", 1, 1), ("sharegpt-long:2k", 1, 1), ("sharegpt-long:4k", 1, 1)]
    # one cache for the first turns' prompts (up to 1,000 tokens), one per bucket: prompt + answer + drafts + 1
    assert capacities == [n + 6 + 3 + 1 for n in (1000, 250, 1400, 2900)]
    refused = bench(4000)
    assert refused.exit_code != 0
    assert "longer than the target's window leaves room for beside --max-new-tokens 4000" in " ".join(refused.output.split())


def test_long_buckets_interrupted_between_caches_report_what_was_measured(setup, tmp_path, monkeypatch):
    """Ctrl-C after the first bucket's cache measured its prompts, before the next one's: a partial report of the
    buckets measured, saying which was not, exit status 130."""
    import eyas.bench.run

    root, _, _ = setup
    target = zoo.save_llama(tmp_path / "target", max_position_embeddings=4096)
    real, calls = eyas.bench.run.run_bench, []

    def stopped(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(eyas.bench.run, "run_bench", stopped)
    result = CliRunner().invoke(app, ["bench", "--target", target, "--draft", str(root / "draft"), "--out",
                                      str(tmp_path / "report"), "--dataset", "sharegpt-long", "--data",
                                      str(long_holdout(tmp_path / "data")), "--mode", "chain:3", "--max-new-tokens", "4",
                                      "--temperature", "0", "--device", "cpu", "--dtype", "fp32"])
    assert result.exit_code == 130, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["partial"] == "interrupted (Ctrl-C) before sharegpt-long:2k was measured"
    assert [r["dataset"] for r in report["rows"]] == ["sharegpt-long:1k"]
    assert not (tmp_path / "report" / "manifest.json").exists()


def test_the_long_context_table_gives_each_bucket_beside_transformers_static_cache(setup, tmp_path, monkeypatch):
    """benchmarks/long_context.py (issue 47's table): per length bucket, over a cache of that bucket's size,
    transformers' static-cache generate, eyas plain and each mode (τ, tok/s, greedy == plain), with run.json."""
    import sys
    from pathlib import Path

    root, _, _ = setup
    target = zoo.save_llama(tmp_path / "target", max_position_embeddings=4096)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import long_context

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--target", target, "--draft", str(root / "draft"), "--data",
                                      str(long_holdout(tmp_path / "data")), "--prompts", "1", "--max-new-tokens", "5",
                                      "--modes", "chain:3", "--device", "cpu", "--dtype", "fp32", "--no-compile",
                                      "--out", str(out)])
    long_context.main()
    rows = json.loads((out / "long_context.json").read_text())["rows"]
    assert [(r["bucket"], r["capacity"]) for r in rows] == [("sharegpt-long:1k", 250 + 5 + 3 + 1),
                                                             ("sharegpt-long:2k", 1400 + 9), ("sharegpt-long:4k", 2900 + 9)]
    for row in rows:
        assert row["transformers_static_tokens_per_second"] > 0 and row["plain_tokens_per_second"] > 0
        [mode] = row["modes"]
        assert mode["mode"] == "chain:3" and mode["matches_plain"] == 1 and mode["tau"] >= 1
    assert "| sharegpt-long:4k | 1 | 2,900 |" in (out / "long_context.md").read_text()
    assert json.loads((out / "run.json").read_text())["script"] == "benchmarks/long_context.py"
