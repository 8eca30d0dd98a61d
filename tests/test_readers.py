"""Readers: three record shapes in three containers; bad input is a counted skip or a clear error."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.data.conversation import Conversation, Skip
from eyas.data.readers import DataSourceError, read_source

SHAREGPT = {"id": "a1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
OPENAI = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}


def records(spec):
    out = list(read_source(str(spec)))
    return [r for r in out if isinstance(r, Conversation)], [r for r in out if isinstance(r, Skip)]


def test_sharegpt_openai_and_prompt_only_in_json_jsonl_parquet_and_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text(json.dumps([SHAREGPT, OPENAI]))
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps({"prompt": "tell a joke"}) + "\n" + json.dumps({"turns": ["q1", "q2"]}) + "\n")
    pq.write_table(pa.table({"instruction": ["sum 1 and 2"], "input": ["show work"]}), tmp_path / "d" / "c.parquet")
    (tmp_path / "d" / "README.md").write_text("not data, ignored in a folder")
    conversations, skips = records(tmp_path / "d")
    assert not skips
    assert [c.messages() for c in conversations] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "tell a joke"}],
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "q2"}],
        [{"role": "user", "content": "sum 1 and 2\n\nshow work"}],
    ]
    assert conversations[0].id == "a1" and conversations[1].id == "d/a.json:1"


def test_malformed_records_are_counted_skips_with_file_and_line(tmp_path):
    lines = [
        json.dumps(SHAREGPT),
        '{"conversations": [{"from": "human", "value": "cut',  # broken JSON line
        json.dumps({"text": "no conversation fields"}),
        json.dumps({"conversations": []}),
        json.dumps({"messages": [{"role": "user", "content": {"image": "x.png"}}]}),
        json.dumps({"messages": [{"role": "narrator", "content": "once upon"}]}),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
        json.dumps({"messages": [{"content": "no role"}]}),
        json.dumps(["not", "an", "object"]),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    conversations, skips = records(path)
    assert [c.id for c in conversations] == ["a1"]
    assert [(s.origin, s.reason) for s in skips] == [
        (f"{path}:2", "invalid JSON"),
        (f"{path}:3", "missing fields"),
        (f"{path}:4", "empty conversation"),
        (f"{path}:5", "non-text content"),
        (f"{path}:6", "unknown role"),
        (f"{path}:7", "non-text content"),
        (f"{path}:8", "missing fields"),
        (f"{path}:9", "not an object"),
    ]
    assert "'narrator'" in skips[4].detail


def test_empty_turn_rules(tmp_path):
    conv = {"conversations": [
        {"from": "gpt", "value": "orphan answer"},  # dropped: nothing prompted it
        {"from": "human", "value": "q1"}, {"from": "human", "value": "more"},  # merged
        {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
        {"from": "gpt", "value": "  "},  # empty: cut here
        {"from": "human", "value": "q3"}, {"from": "gpt", "value": "a3"},
    ]}
    (tmp_path / "e.json").write_text(json.dumps([conv]))
    conversations, _ = records(tmp_path / "e.json")
    assert conversations[0].messages() == [
        {"role": "user", "content": "q1\n\nmore"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]


def test_json_array_cut_short_keeps_complete_records_and_reports_the_cut(tmp_path):
    text = json.dumps([SHAREGPT, SHAREGPT | {"id": "a2"}, SHAREGPT | {"id": "a3"}], indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"a3"') + 10])
    conversations, skips = records(path)
    assert [c.id for c in conversations] == ["a1", "a2"]
    assert len(skips) == 1 and skips[0].reason == "invalid JSON" and "rest of the file" in skips[0].detail


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("data.csv", b"a,b\n1,2\n", "not a data file eyas reads"),
        ("data.parquet", b"this is not parquet", "not a Parquet file"),
        ("data.json", b"\x89PNG\r\n\x1a\n\x00\x00", "not a JSON"),
        ("data.jsonl", b"\x00\x01\x02binary\n", "not JSON Lines"),
    ],
)
def test_a_file_that_is_not_data_is_a_clear_error(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataSourceError, match=message):
        list(read_source(str(tmp_path / name)))


def test_cli_reports_bad_data_without_a_traceback(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    result = CliRunner().invoke(app, ["prepare", "--target", "demo", "--data", str(tmp_path / "data.csv"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "not a data file eyas reads" in result.output and "Traceback" not in result.output


def test_a_record_nested_too_deep_is_skipped_and_counted_like_other_bad_lines(tmp_path):
    """A line of 100,000 nested arrays is no conversation: Python's JSON reader runs out of recursion on it, which must
    not stop the whole read (a JSONL line is skipped; inside an array it ends the file's records, as a broken record
    does; a lone top-level object is refused in one line)."""
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    lines = tmp_path / "deep.jsonl"
    lines.write_text(json.dumps(SHAREGPT) + "\n" + deep + "\n" + json.dumps(SHAREGPT | {"id": "a2"}) + "\n")
    conversations, skips = records(lines)
    assert [c.id for c in conversations] == ["a1", "a2"]
    assert [(s.origin, s.reason) for s in skips] == [(f"{lines}:2", "invalid JSON")] and "deeper" in skips[0].detail
    array = tmp_path / "deep.json"
    array.write_text("[" + json.dumps(SHAREGPT) + ", " + deep + "]")
    conversations, skips = records(array)
    assert [c.id for c in conversations] == ["a1"] and "deeper" in skips[0].detail
    single = tmp_path / "single.json"
    single.write_text(deep)
    with pytest.raises(DataSourceError, match="deeper"):
        records(single)


def test_text_utf8_cannot_encode_is_skipped_and_counted_not_a_traceback(tmp_path):
    """JSON's ``\\ud800`` escape spells a lone surrogate, which Python reads into a str that UTF-8 cannot encode: the
    tokenizer and the manifest could not take it, so the record is a counted skip — whether in a turn or in the id —
    and prepare goes on with the others."""
    lines = tmp_path / "surrogates.jsonl"
    turn = '{"id": "s1", "conversations": [{"from": "human", "value": "a\\ud800b"}, {"from": "gpt", "value": "c"}]}'
    ident = '{"id": "\\udfff", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'
    lines.write_text(json.dumps(SHAREGPT) + "\n" + turn + "\n" + ident + "\n")
    conversations, skips = records(lines)
    assert [c.id for c in conversations] == ["a1"]
    assert [(s.origin, s.reason) for s in skips] == [(f"{lines}:2", "invalid text"), (f"{lines}:3", "invalid text")]
    assert skips[0].detail.startswith("turn 1: surrogates not allowed") and skips[1].detail.startswith("its id")
