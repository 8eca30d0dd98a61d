"""Was a DATA_DIR prepared for this target? The one check capture, online training and bench make before they read it.

A DATA_DIR holds token ids, which mean text only to the tokenizer that wrote them. Handed to another target, its ids
either fall outside the target's vocabulary (the embedding then stops in an ``IndexError``) or, worse, fall inside it
and are read as other words: a store, a drafter, a benchmark of nonsense, without a word. So:

- every id of every split must lie inside the target's vocabulary (its config's ``vocab_size``: the embedding's rows);
- the tokenizer the DATA_DIR's manifest records must be the target's: ``tokenizer_vocab_sha256`` (the SHA-256 of the
  vocabulary, token → id, which every version of the tokenizer libraries reads alike) or, in a DATA_DIR prepared
  before that was recorded, ``tokenizer_sha256`` (the SHA-256 of the tokenizer's serialization).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, read_manifest


def tokenizer_vocab_sha256(tokenizer) -> str:
    """The SHA-256 of the tokenizer's vocabulary (every token and its id, added tokens included)."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """The SHA-256 of the tokenizer's serialization (its vocabulary, merges, normalizers, …); DATA_DIRs record it as
    part of what ``eyas prepare`` was run with."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def require_data_fits(data_dir: Path, target_spec: str, trust_remote_code: bool = False) -> None:
    """Refuse, in one line naming the file and what to do, a DATA_DIR whose token ids fall outside ``target_spec``'s
    vocabulary or whose recorded tokenizer is not the target's."""
    from eyas.target.layout import text_config
    from eyas.target.loading import load_target_config

    data_dir = Path(data_dir)
    config, source = load_target_config(target_spec, trust_remote_code)
    manifest = read_manifest(data_dir) or {}
    made_for = f" (its manifest names target {manifest['target']!r})" if manifest.get("target") else ""
    remedy = f"prepare the data for this target (eyas prepare --target {target_spec} … --out NEW_DIR), or give the " \
             "target it was prepared for"
    vocab = int(getattr(text_config(config), "vocab_size", 0) or 0)
    for path in sorted(data_dir.glob("*.parquet")):
        outside = _first_id_outside(path, vocab)
        if outside is not None:
            sample, token = outside
            raise EyasError(f"{path}: sample {sample!r} holds token id {token}, outside the {vocab:,} ids of target "
                            f"{target_spec!r}'s vocabulary: the DATA_DIR was prepared for another tokenizer{made_for}; "
                            f"{remedy}")
    other = _tokenizer_differs(manifest, source, trust_remote_code)
    if other is not None:
        raise EyasError(f"{data_dir / MANIFEST}: the DATA_DIR was tokenized by another tokenizer than the one of "
                        f"target {target_spec!r}{made_for} ({other}): its token ids would read as other text; {remedy}")


def _first_id_outside(path: Path, vocab: int) -> tuple[str, int] | None:
    """The first sample of a split file holding an id outside ``0..vocab-1`` and that id, or None (also when the
    vocabulary size is unknown)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["id", "input_ids"])
    flat = pc.list_flatten(table.column("input_ids"))
    if not vocab or len(flat) == 0:
        return None
    low, high = (value.as_py() for value in pc.min_max(flat).values())
    if 0 <= low and high < vocab:
        return None
    for sample, ids in zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist(), strict=True):
        bad = next((token for token in ids if not 0 <= token < vocab), None)
        if bad is not None:
            return sample, bad
    return None


def _tokenizer_differs(manifest: dict, source: str, trust_remote_code: bool) -> str | None:
    """How the target's tokenizer differs from the one the DATA_DIR records, or None when they agree or nothing tells
    (no tokenizer recorded, or the target ships none)."""
    recorded_vocab, recorded = manifest.get("tokenizer_vocab_sha256"), manifest.get("tokenizer_sha256")
    if not recorded_vocab and not recorded:
        return None
    from eyas.target.loading import load_tokenizer

    tokenizer = load_tokenizer(source, trust_remote_code)
    if tokenizer is None:
        return None
    if recorded_vocab:
        return None if tokenizer_vocab_sha256(tokenizer) == recorded_vocab else "their vocabularies differ"
    return None if tokenizer_sha256(tokenizer) == recorded else "their serializations' SHA-256 differ"
