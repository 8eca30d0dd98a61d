"""What tells one target's weights from another's, cheaply enough for a 1 T-parameter checkpoint.

Two fingerprints, recorded by capture (in the store's manifest) and by training (in RUN_DIR and, through export, in
the DRAFT_DIR's manifest), and compared by every stage that is handed a target with them
(:func:`eyas.target.facts.target_mismatch`):

- ``weights_sha256``: the SHA-256 of the token embedding, lm_head and final norm, read whole
  (:func:`eyas.target.weights.weights_sha256`). It tells apart base and instruct siblings, but not two targets that
  differ only inside the decoder layers (a merged LoRA, a fine-tune that kept the embedding).
- ``weights_sample``: every tensor of the checkpoint — its name, dtype, shape and a few kilobytes of its bytes (the
  start, the middle and the end of its data) — hashed per decoder layer (``{"layer 0": digest, …, "other": digest}``).
  A fine-tune or a merged adapter changes every element of the matrices it touches, so the sampled bytes differ; a
  mismatch names the layers. The cost is three small reads per tensor, whatever its size: for a checkpoint of 100,000
  tensors, 300,000 reads of 1 KiB, read straight from the safetensors files (their header gives each tensor's place).
  An edit confined to rows that no window sees (one fact rewritten in one MLP) goes unnoticed: ``eyas capture --check``
  recomputes states and catches any change that matters to them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

from eyas.errors import EyasError

FINGERPRINTS = ("weights_sha256", "weights_sample")  # the keys a target's facts carry them under
SCHEME = "eyas-sample/1"  # recorded beside the digests: a later scheme is never compared with this one
WINDOW = 1024  # bytes read at each of a tensor's three places
_LAYER = re.compile(r"\.(?:layers|blocks|h)\.(\d+)\.")


def weights_fingerprint(target_source: str, trust_remote_code: bool = False) -> dict:
    """``{"weights_sha256": …, "weights_sample": …}`` of the target (each None when its checkpoint is not safetensors):
    what the stage records beside the target's facts."""
    from eyas.target.weights import checkpoint_files, weights_sha256

    files = checkpoint_files(target_source, trust_remote_code)
    return {"weights_sha256": weights_sha256(target_source, trust_remote_code),
            "weights_sample": None if files is None else sample_digests(files)}


def sample_digests(files: list[Path]) -> dict:
    """The sampled fingerprint of the safetensors ``files``: ``{"scheme": SCHEME, "groups": {group: hex digest}}``, one
    digest per decoder layer (``"layer N"``) and one for the other tensors (``"other"``)."""
    hashers: dict[str, hashlib._Hash] = {}
    entries = []
    for path in files:
        header, data_start = _header(path)
        entries += [(name, path, data_start, info) for name, info in header.items() if name != "__metadata__"]
    entries.sort(key=lambda entry: entry[0])  # by tensor name: the same digests however the tensors are spread over files
    handles: dict[Path, int] = {}
    try:
        for name, path, data_start, info in entries:
            fd = handles.get(path)
            if fd is None:
                fd = handles[path] = os.open(path, os.O_RDONLY)
            digest = hashers.setdefault(group_of(name), hashlib.sha256())
            begin, end = (data_start + offset for offset in info["data_offsets"])
            digest.update(f"{name} {info['dtype']} {info['shape']} {end - begin}\n".encode())
            for start in _windows(begin, end):
                digest.update(os.pread(fd, min(WINDOW, end - start), start))
    finally:
        for fd in handles.values():
            os.close(fd)
    return {"scheme": SCHEME, "groups": {group: hasher.hexdigest()[:16] for group, hasher in sorted(hashers.items())}}


def group_of(tensor_name: str) -> str:
    """The group a tensor's bytes are hashed in: its decoder layer (``"layer 12"``), else ``"other"``."""
    found = _LAYER.search(tensor_name)
    return f"layer {int(found.group(1))}" if found else "other"


def sample_mismatch(recorded: dict | None, live: dict | None) -> str | None:
    """Which weights differ between two sampled fingerprints (``"decoder layers 3, 4"``), or None when they agree or
    cannot be compared (either missing, or of another scheme)."""
    if not recorded or not live or recorded.get("scheme") != SCHEME or live.get("scheme") != SCHEME:
        return None
    old, new = recorded.get("groups", {}), live.get("groups", {})
    differ = [group for group in sorted(set(old) | set(new), key=_group_order) if old.get(group) != new.get(group)]
    if not differ:
        return None
    layers = [group.split()[1] for group in differ if group != "other"]
    parts = ([_layers(layers)] if layers else []) + (["tensors outside the decoder layers"] if "other" in differ else [])
    return " and ".join(parts)


def _group_order(group: str) -> tuple[int, int]:
    return (1, 0) if group == "other" else (0, int(group.split()[1]))


def _layers(layers: list[str], most: int = 6) -> str:
    """``decoder layer 3``, ``decoder layers 3, 4``, or past ``most`` of them ``40 decoder layers (0, 1, 2, 3, 4, 5, …)``."""
    if len(layers) == 1:
        return f"decoder layer {layers[0]}"
    if len(layers) <= most:
        return f"decoder layers {', '.join(layers)}"
    return f"{len(layers)} decoder layers ({', '.join(layers[:most])}, …)"


def _windows(begin: int, end: int) -> list[int]:
    """Where a tensor's sampled windows start: all of it when it is small, else its start, middle and end."""
    size = end - begin
    if size <= 3 * WINDOW:
        return list(range(begin, end, WINDOW))
    return [begin, begin + (size - WINDOW) // 2, end - WINDOW]


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name → dtype, shape, data offsets) and where its data begins."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"a header of {length:,} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise EyasError(f"{path}: not a readable safetensors file ({err}); the target's checkpoint is damaged: "
                        "download or convert it again") from None
    return header, 8 + length
