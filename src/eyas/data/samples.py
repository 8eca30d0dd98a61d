"""Training samples on disk: Parquet with ``id`` (string), ``input_ids`` (int32 list), ``loss_mask`` (uint8 list)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eyas.io import atomic_path

SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])


@dataclass
class Sample:
    """One rendered conversation: token ids and its 0/1 assistant loss mask."""

    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


def write_samples(samples: list[Sample], path: Path) -> None:
    """Write samples to a Parquet file atomically (zstd-compressed)."""
    table = pa.table(
        {
            "id": [s.id for s in samples],
            "input_ids": [s.input_ids for s in samples],
            "loss_mask": [s.loss_mask for s in samples],
        },
        schema=SCHEMA,
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_samples(path: Path) -> list[Sample]:
    """Read every sample of a Parquet file written by :func:`write_samples`."""
    table = pq.read_table(path, schema=SCHEMA)
    ids = table.column("id").to_pylist()
    tokens = table.column("input_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    return [
        Sample(i, np.asarray(t, dtype=np.int32), np.asarray(m, dtype=np.uint8)) for i, t, m in zip(ids, tokens, masks, strict=True)
    ]


_REPEAT = re.compile(r"#[0-9]+$")  # what repeated_id appends


def repeated_id(conversation_id: str, n: int) -> str:
    """The id of the ``n``-th (n ≥ 2) record that came with ``conversation_id`` and other content (e.g. the same
    prompts answered again at another temperature, from a second journal)."""
    return f"{conversation_id}#{n}"


def conversation_of(sample_id: str) -> str:
    """The conversation a sample id belongs to: the id without :func:`repeated_id`'s suffix."""
    return _REPEAT.sub("", sample_id)


def pad_right(rows: list[np.ndarray], dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """Stack 1-D rows into [B, width] (default: the longest row), zero-padded on the right (the padding side capture
    requires)."""
    longest = max(len(r) for r in rows)
    if width is not None and width < longest:
        raise ValueError(f"width {width} is shorter than the longest row ({longest})")
    out = torch.zeros(len(rows), longest if width is None else width, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def batch_inputs(samples: list[Sample], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded forward batch of samples: (input_ids long [B, T], attention_mask long [B, T]); T = ``width``
    (default: the longest sample)."""
    ids = pad_right([s.input_ids for s in samples], torch.long, width)
    mask = pad_right([np.ones(len(s.input_ids), dtype=np.int64) for s in samples], torch.long, width)
    return ids, mask
