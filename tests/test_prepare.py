"""`eyas prepare` end to end: DATA_DIR files, split, duplicates, length policy, rerun, regeneration."""

import json
import shutil

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

import zoo
from eyas.cli import app
from eyas.data.options import PrepareOptions, RegenerationOptions
from eyas.data.prepare import AlreadyPrepared, prepare
from eyas.data.samples import read_samples
from eyas.errors import EyasError
from eyas.target.loading import load_tokenizer, resolve_target


def train_tokens(directory):
    """Every training sample of DATA_DIR as comparable plain data."""
    return sorted((s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in read_samples(directory / "train.parquet"))


def journal_records(path):
    """A journal's records, split at newlines only (U+2028 inside a string is not a line break here)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def write_dataset(path, n=40):
    rows = []
    for i in range(n):
        rows.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"The answer is {2 * i}."},
            {"from": "human", "value": "Thanks! And doubled?"},
            {"from": "gpt", "value": f"Doubled, it is {4 * i}."},
        ]})
    rows.append(dict(rows[0], id="dup"))  # same content as c0
    rows.append({"id": "bad", "conversations": [{"from": "alien", "value": "?"}]})
    rows.append({"id": "long", "conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "ok"}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prepare_writes_a_complete_data_dir(tmp_path):
    source = write_dataset(tmp_path / "chats.jsonl")
    out = tmp_path / "data"
    stats = prepare(PrepareOptions(target="demo", data=[str(source)], out=out, holdout=0.25, draft_vocab_size=300, max_length=128))
    assert stats.records_read == 43
    assert stats.skipped == {"unknown role": 1} and stats.duplicates == 1
    assert stats.dropped == {"no assistant token within max length": 1}  # the long one: its answer is cut off
    train, holdout = read_samples(out / "train.parquet"), read_samples(out / "holdout.parquet")
    assert len(train) + len(holdout) == 40 == stats.train_samples + stats.holdout_samples
    assert 0 < len(holdout) < 20
    assert {s.id for s in train}.isdisjoint({s.id for s in holdout})
    tok = load_tokenizer(resolve_target("demo"))
    sample = next(s for s in train + holdout if s.id == "c7")
    assert sample.input_ids.dtype.name == "int32" and sample.loss_mask.dtype.name == "uint8"
    masked = tok.decode(sample.input_ids[sample.loss_mask.astype(bool)])
    assert masked == "The answer is 14.<|im_end|>Doubled, it is 28.<|im_end|>"
    vocab = load_file(str(out / "vocab.safetensors"))
    assert int(vocab["t2d"].sum()) == 300 and vocab["d2t"].shape == (300,) and vocab["counts"].shape == (49152,)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert bool(vocab["t2d"][im_end]) and int(vocab["counts"][im_end]) == 2 * len(train)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stats"]["masked_tokens"] == stats.masked_tokens > 0
    assert manifest["options"]["max_length"] == 128 and manifest["vocab_size"] == 49152
    assert len(manifest["tokenizer_sha256"]) == 64 and len(manifest["chat_template_sha256"]) == 64

    # Same inputs again: nothing to do; the split is deterministic when forced.
    with pytest.raises(AlreadyPrepared):
        prepare(PrepareOptions(target="demo", data=[str(source)], out=out, holdout=0.25, draft_vocab_size=300, max_length=128))
    prepare(PrepareOptions(target="demo", data=[str(source)], out=out, holdout=0.25, draft_vocab_size=300, max_length=128,
                           force=True))
    assert [s.id for s in read_samples(out / "holdout.parquet")] == [s.id for s in holdout]


def test_a_second_answer_set_of_a_conversation_falls_on_its_side_of_the_split(tmp_path):
    """Two sources with the same ids and other answers (e.g. the same prompts regenerated at T = 0 and T = 0.8): both
    samples of a conversation are kept, and both are held out or both trained on — a held-out prompt's second answer
    in training would be a leak (the T = 0.8 holdout would be scored on training data)."""
    from eyas.data.samples import conversation_of, repeated_id

    first = write_dataset(tmp_path / "greedy.jsonl")
    second = tmp_path / "sampled.jsonl"
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    for row in rows:
        for turn in row["conversations"]:
            if turn["from"] == "gpt":
                turn["value"] += " (sampled)"
    second.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "data"
    prepare(PrepareOptions(target="demo", data=[str(first), str(second)], out=out, holdout=0.25, draft_vocab_size=300,
                           max_length=128))
    train, holdout = read_samples(out / "train.parquet"), read_samples(out / "holdout.parquet")
    assert len(train) + len(holdout) == 80  # 40 conversations × 2 answer sets ("dup" repeats c0 in both)
    side = {}
    for name, samples in (("train", train), ("holdout", holdout)):
        for sample in samples:
            side.setdefault(conversation_of(sample.id), set()).add(name)
    assert len(side) == 40 and all(len(sides) == 1 for sides in side.values())
    assert {"train"} in side.values() and {"holdout"} in side.values()
    assert sum(s.id.endswith("#2") for s in train + holdout) == 40
    from eyas.data.benchmarks import holdout_prompts  # the bench asks each held-out conversation's prompt once

    assert len(holdout_prompts(out)) == sum(sides == {"holdout"} for sides in side.values()) == len(holdout) // 2
    assert conversation_of(repeated_id("x#1", 2)) == "x#1" and conversation_of("c#2x") == "c#2x"


def test_length_policy_drop_and_truncate(tmp_path):
    source = write_dataset(tmp_path / "chats.jsonl", n=5)
    drop = prepare(PrepareOptions(target="demo", data=[str(source)], out=tmp_path / "a", max_length=200, overflow="drop", holdout=0))
    assert drop.dropped == {"longer than max length": 1} and drop.train_samples == 5 and drop.truncated == 0
    trunc = prepare(PrepareOptions(target="demo", data=[str(source)], out=tmp_path / "b", max_length=60, holdout=0))
    assert trunc.truncated == 6 and trunc.dropped == {"no assistant token within max length": 1}
    assert trunc.train_samples == 5
    assert all(len(s.input_ids) == 60 for s in read_samples(tmp_path / "b" / "train.parquet"))


def test_limit_and_prompt_only_records_need_regeneration(tmp_path):
    source = write_dataset(tmp_path / "chats.jsonl")
    stats = prepare(PrepareOptions(target="demo", data=[str(source)], out=tmp_path / "l", limit=7, holdout=0))
    assert stats.train_samples == 7
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"turns": ["a", "b"]}) + "\n")
    with pytest.raises(EyasError, match=r"no training samples(.|\n)*prompt-only record: 2"):
        prepare(PrepareOptions(target="demo", data=[str(prompts)], out=tmp_path / "p"))
    runner = CliRunner()
    result = runner.invoke(app, ["prepare", "--target", "demo", "--data", str(prompts), "--out", str(tmp_path / "q")])
    assert result.exit_code == 2 and "prompt-only data needs --regenerate" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(EyasError, match=f"0 records read in {empty} — no records at all"):  # names the file
        prepare(PrepareOptions(target="demo", data=[str(empty)], out=tmp_path / "e"))
    twice = tmp_path / "twice.jsonl"  # a duplicate among the reasons: its count was an IndexError
    chat = {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"}]}
    twice.write_text("".join(json.dumps(chat) + "\n" for _ in range(2)))
    with pytest.raises(EyasError, match=r"2 records read in .*twice.jsonl — .*: 1; exact duplicates: 1"):
        prepare(PrepareOptions(target="demo", data=[str(twice)], out=tmp_path / "t", max_length=2))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 2-layer random Llama with the demo tokenizer: a real target directory, fast to run."""
    return zoo.save_chat_target(tmp_path_factory.mktemp("tiny-target"), num_hidden_layers=2)


def test_prepare_with_in_process_regeneration(tmp_path, tiny_target):
    source = write_dataset(tmp_path / "chats.jsonl", n=4)
    out = tmp_path / "regen"
    options = RegenerationOptions(max_new_tokens=6, batch_size=4)
    stats = prepare(PrepareOptions(target=str(tiny_target), data=[str(source)], out=out, holdout=0, regenerate=True,
                                   regeneration=options))
    assert stats.regeneration["conversations_done"] == 5  # 4 + the long one (dup and bad are gone before)
    journal = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(journal) == 5
    for conversation in journal:
        for turn in conversation["turns"]:
            assert turn["regenerated"] == (turn["role"] == "assistant")
            if turn["role"] == "assistant":
                assert "The answer is" not in turn["content"]  # the dataset's answer was replaced
    assert stats.train_samples >= 4


def test_regeneration_at_several_temperatures_keeps_every_answer_set(tmp_path, tiny_target, monkeypatch):
    """--temperature 0,0.8: every conversation answered once at each temperature by one load of the target, each set
    journaled in its own folder (its greedy set the very answers a one-temperature run writes), both in DATA_DIR on
    one side of the split; a rerun resumes both sets and regenerates nothing."""
    import eyas.target.loading

    source = write_dataset(tmp_path / "chats.jsonl", n=4)
    greedy = tmp_path / "greedy"
    prepare(PrepareOptions(target=str(tiny_target), data=[str(source)], out=greedy, holdout=0, regenerate=True,
                           regeneration=RegenerationOptions(max_new_tokens=6, batch_size=4)))
    both = tmp_path / "both"
    loads, load = [], eyas.target.loading.load_target
    monkeypatch.setattr(eyas.target.loading, "load_target", lambda *a, **k: loads.append(a) or load(*a, **k))
    result = CliRunner().invoke(app, ["prepare", "--target", str(tiny_target), "--data", str(source), "--out", str(both),
                                      "--holdout", "0.5", "--regenerate", "--temperature", "0,0.8",
                                      "--max-new-tokens", "6", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    assert len(loads) == 1  # the target loaded once, for both sets of answers
    assert not list(both.glob("regenerated*.jsonl"))  # no journal of unknown temperature in DATA_DIR itself
    sets = {t: {c["id"]: c for c in journal_records(both / f"regenerated-T{t}" / "regenerated.jsonl")} for t in ("0", "0.8")}
    assert sets["0"] == {c["id"]: c for c in journal_records(greedy / "regenerated.jsonl")}
    assert set(sets["0.8"]) == set(sets["0"]) and sets["0.8"] != sets["0"]  # the same conversations, drawn answers

    manifest = json.loads((both / "manifest.json").read_text())
    assert manifest["options"]["regeneration"]["temperature"] == [0.0, 0.8]
    assert manifest["stats"]["regeneration"]["conversations_done"] == 2 * 5
    samples = {}
    for split in ("train", "holdout"):
        for sample in read_samples(both / f"{split}.parquet"):
            samples.setdefault(sample.id, set()).add(split)
    assert all(len(splits) == 1 for splits in samples.values())  # a conversation's answer sets on one side
    train_ids = [s.id for s in read_samples(both / "train.parquet")]
    assert len(train_ids) > len(set(train_ids))  # both answers of a conversation trained on

    again = CliRunner().invoke(app, ["prepare", "--target", str(tiny_target), "--data", str(source), "--out", str(both),
                                     "--holdout", "0.5", "--regenerate", "--temperature", "0,0.8",
                                     "--max-new-tokens", "6", "--batch-size", "4", "--force"])
    assert again.exit_code == 0, again.output
    assert json.loads((both / "manifest.json").read_text())["stats"]["regeneration"]["conversations_resumed"] == 2 * 5


def test_journals_answered_at_another_temperature_or_length_are_not_resumed(tmp_path, tiny_target):
    """A DATA_DIR's journals record what their answers were generated with: a rerun asking for another temperature or
    answer length (here with --force over a finished run) is refused in one line naming the folder and both settings,
    before anything is resumed or generated; the same settings resume."""
    source = write_dataset(tmp_path / "chats.jsonl", n=2)
    out = tmp_path / "data"

    def run(*extra):
        return CliRunner().invoke(app, ["prepare", "--target", str(tiny_target), "--data", str(source), "--out", str(out),
                                        "--holdout", "0", "--regenerate", "--max-new-tokens", "4", "--force", *extra])

    assert run().exit_code == 0
    assert json.loads((out / "regenerated-settings.json").read_text()) == {"temperature": 0.0, "max_new_tokens": 4}
    journal = (out / "regenerated.jsonl").read_bytes()
    for extra, said in ((["--temperature", "0.8"], "--temperature 0, --max-new-tokens 4, not --temperature 0.8, "
                                                   "--max-new-tokens 4, --seed 0"),
                        (["--max-new-tokens", "5"], "not --temperature 0, --max-new-tokens 5")):
        refused = run(*extra)
        assert refused.exit_code != 0 and said in " ".join(refused.output.split()), refused.output
        assert "delete" in refused.output and (out / "regenerated.jsonl").read_bytes() == journal
    again = run("--seed", "3")  # the seed does not shape greedy answers
    assert again.exit_code == 0, again.output
    assert json.loads((out / "manifest.json").read_text())["stats"]["regeneration"]["conversations_resumed"] == 3


def test_a_regeneration_journal_is_data_as_it_is(tmp_path, tiny_target):
    """What was regenerated so far (a stopped run's journal) prepares into exactly the samples the
    finished run made, truncated answers included (no end-of-turn taught after them)."""
    source = write_dataset(tmp_path / "chats.jsonl", n=4)
    done = tmp_path / "done"
    prepare(PrepareOptions(target=str(tiny_target), data=[str(source)], out=done, holdout=0, regenerate=True,
                           regeneration=RegenerationOptions(max_new_tokens=6, batch_size=4)))
    journal = [json.loads(line) for line in (done / "regenerated.jsonl").read_text().splitlines()]
    assert any(t.get("truncated") for c in journal for t in c["turns"])  # random weights: no EOS within 6 tokens
    again = tmp_path / "again"
    prepare(PrepareOptions(target=str(tiny_target), data=[str(done / "regenerated.jsonl")], out=again, holdout=0))

    assert train_tokens(again) == train_tokens(done)


def test_regeneration_on_several_workers_matches_one_and_resumes_across_worker_counts(tmp_path, tiny_target,
                                                                                      monkeypatch):
    """Two worker processes (here on the CPU, standing in for two GPUs) answer exactly as one process;
    a run resumed with another worker count regenerates only what no journal holds yet."""
    import eyas.data.regenerate_workers as workers_module

    source = write_dataset(tmp_path / "chats.jsonl", n=6)
    with open(source, "a", encoding="utf-8") as handle:  # line separators inside strings must not split records
        handle.write(json.dumps({"id": "seps", "conversations": [{"from": "human", "value": "a\u2028b\x85c"},
                                                                 {"from": "gpt", "value": "d"}]}, ensure_ascii=False) + "\n")
    options = RegenerationOptions(max_new_tokens=5, batch_size=2)
    one = tmp_path / "one"
    prepare(PrepareOptions(target=str(tiny_target), data=[str(source)], out=one, holdout=0, regenerate=True,
                           regeneration=options))
    expected = {c["id"]: c for c in journal_records(one / "regenerated.jsonl")}

    two = tmp_path / "two"
    two.mkdir()
    # A previous single-process run that finished c0 and c1 only.
    (two / "regenerated.jsonl").write_text("".join(json.dumps(expected[c]) + "\n" for c in ("c0", "c1")))
    monkeypatch.setattr(workers_module, "worker_gpus", lambda workers: ["", ""])  # two CPU workers
    stats = prepare(PrepareOptions(target=str(tiny_target), data=[str(source)], out=two, holdout=0, regenerate=True,
                                   regeneration=options, workers=2))
    assert stats.regeneration["conversations_resumed"] == 2 and stats.regeneration["conversations_done"] == 6
    shards = [[c["id"] for c in journal_records(two / f"regenerated.worker{i}.jsonl")] for i in (0, 1)]
    assert sorted(shards[0] + shards[1]) == sorted(set(expected) - {"c0", "c1"}) and shards[0] and shards[1]
    got = {c["id"]: c for journal in sorted(two.glob("regenerated*.jsonl")) for c in journal_records(journal)}
    assert got == expected  # greedy answers do not depend on the worker that wrote them
    assert not list(two.glob("regenerate-input*")) and sorted(p.name for p in two.glob("regenerate.worker*.log")) == [
        "regenerate.worker0.log", "regenerate.worker1.log"]  # hand-over files removed, logs kept

    assert train_tokens(two) == train_tokens(one)


def test_a_failing_worker_names_its_log(tmp_path, tiny_target, monkeypatch):
    import eyas.data.regenerate_workers as workers_module

    source = write_dataset(tmp_path / "chats.jsonl", n=4)
    # The parent reads only the config and tokenizer; without weights, loading fails in the workers.
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_target, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.setattr(workers_module, "worker_gpus", lambda workers: ["", ""])
    with pytest.raises(EyasError, match=r"worker \d \(GPU \) exited with status 1; its log is .*worker\d\.log"):
        prepare(PrepareOptions(target=str(broken), data=[str(source)], out=tmp_path / "o", holdout=0,
                               regenerate=True, regeneration=RegenerationOptions(max_new_tokens=3), workers=2))


def test_regeneration_skips_turns_that_start_beyond_max_length(tmp_path, tiny_target):
    rows = [{"id": "x", "conversations": [
        {"from": "human", "value": "short question"}, {"from": "gpt", "value": "short answer"},
        {"from": "human", "value": "word " * 300}, {"from": "gpt", "value": "answer to a very long question"},
        {"from": "human", "value": "late question"}, {"from": "gpt", "value": "late answer"},
    ]}, {"id": "y", "conversations": [{"from": "human", "value": "word " * 300}, {"from": "gpt", "value": "no"}]}]
    source = tmp_path / "long.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "o"
    stats = prepare(PrepareOptions(target=str(tiny_target), data=[str(source)], out=out, holdout=0, max_length=120,
                                   regenerate=True, regeneration=RegenerationOptions(max_new_tokens=4)))
    journal = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert [c["id"] for c in journal] == ["x"]
    assert [t["role"] for t in journal[0]["turns"]] == ["user", "assistant"]  # turns 3+ would start past 120 tokens
    assert stats.clipped_for_length == 1 and stats.dropped["first prompt longer than max length"] == 1
