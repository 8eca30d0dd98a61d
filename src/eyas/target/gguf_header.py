"""A GGUF file's header — its metadata and tensor table — read without touching the tensor data.

Two uses: every GGUF is judged here before anything trusts it (magic, version, a header that parses,
tensor data that fits in the file: a truncated download fails with one line naming the file, not deep
inside a dequantization), and ``eyas inspect`` builds the target's config from this metadata alone.
String arrays (a 262,144-token vocabulary) are skipped, not decoded, so the header of Gemma-3-270M
reads in well under a second where the ``gguf`` package's reader decodes every token first.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.errors import TargetNotFoundError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEPT_ARRAY = 1024  # longer arrays (vocabularies, scores, merges) are kept as their length only


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself: metadata (long arrays as their length) and tensor shapes."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]  # GGUF tensor name → shape in torch order

    @property
    def architecture(self) -> str:
        """llama.cpp's architecture name (``llama``, ``gemma3``, ...)."""
        return str(self.metadata.get("general.architecture", ""))

    @property
    def has_tokenizer(self) -> bool:
        """Whether the file carries a tokenizer (transformers builds one from these keys)."""
        return "tokenizer.ggml.model" in self.metadata

    @property
    def has_chat_template(self) -> bool:
        """Whether the file carries a chat template (base models usually do not)."""
        return bool(self.metadata.get("tokenizer.chat_template"))


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s header and check its tensor data is all there; one line naming the file if not."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise _bad(path, "it does not start with the GGUF magic bytes (not a GGUF file, or a download "
                                 "saved as an error page)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return _parse(path, view)
    except OSError as err:
        raise TargetNotFoundError(f"GGUF file {path} cannot be read ({err.strerror or err}); check the path and "
                                  "its permissions") from None


def _parse(path: Path, view: mmap.mmap) -> GGUFHeader:
    reader = _Reader(view)
    try:
        version = reader.scalar("I")
        if version not in (2, 3):
            raise _bad(path, f"it is GGUF version {version}; eyas reads versions 2 and 3 (re-convert it with a "
                             "current llama.cpp)")
        tensor_count, kv_count = reader.scalar("Q"), reader.scalar("Q")
        metadata = {reader.string(): reader.value(reader.scalar("I")) for _ in range(kv_count)}
        table = [_tensor_entry(reader) for _ in range(tensor_count)]
    except (struct.error, UnicodeDecodeError, ValueError) as err:
        raise _bad(path, f"its header is cut short or corrupt ({err}); the file is truncated or damaged, "
                         "download it again") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-reader.at // alignment) * alignment
    needed = data_start + max((offset + _nbytes(path, kind, shape) for _, shape, kind, offset in table), default=0)
    if needed > len(view):
        raise _bad(path, f"it is truncated: its tensors need {needed:,} bytes, the file has {len(view):,}; "
                         "download it again")
    if "general.architecture" not in metadata:
        raise _bad(path, "its metadata names no general.architecture")
    return GGUFHeader(path, version, metadata, {name: shape for name, shape, _, _ in table})


class _Reader:
    """Little-endian values from a buffer, one after another."""

    def __init__(self, view: mmap.mmap):
        self.view, self.at = view, 4  # after the magic

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.view, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        if self.at + length > len(self.view):
            raise ValueError(f"a string of {length} bytes runs past the end")
        text = self.view[self.at:self.at + length].decode("utf-8")
        self.at += length
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if count > _KEPT_ARRAY:
            self.skip(item, count)
            return _Skipped(count)
        return [self.value(item) for _ in range(count)]

    def skip(self, kind: int, count: int) -> None:
        if kind in _SCALARS:
            self.at += count * struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            for _ in range(count):  # each string says its own length: walk them
                self.at += 8 + struct.unpack_from("<Q", self.view, self.at)[0]
        else:
            for _ in range(count):
                self.value(kind)
        if self.at > len(self.view):
            raise ValueError("an array runs past the end")


@dataclass(frozen=True)
class _Skipped:
    """A long metadata array, not decoded: only its length."""

    length: int

    def __len__(self) -> int:
        return self.length


def _tensor_entry(reader: _Reader) -> tuple[str, tuple[int, ...], int, int]:
    name = reader.string()
    dims = [reader.scalar("Q") for _ in range(reader.scalar("I"))]
    kind, offset = reader.scalar("I"), reader.scalar("Q")
    return name, tuple(reversed(dims)), kind, offset  # ggml lists the fastest-moving dimension first


def _nbytes(path: Path, kind: int, shape: tuple[int, ...]) -> int:
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        raise TargetNotFoundError("reading GGUF files needs the 'gguf' package: pip install gguf") from None
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise _bad(path, f"it holds tensors of unknown ggml type {kind}; upgrade the gguf package "
                         "(pip install -U gguf)") from None
    elements = 1
    for dim in shape:
        elements *= dim
    return elements // block * size


def _bad(path: Path, why: str) -> TargetNotFoundError:
    return TargetNotFoundError(f"GGUF file {path} is unusable: {why}")


# Architectures whose transformers config takes more than the metadata table (tensor names, the model's name,
# per-layer lists): transformers reads those files itself, more slowly.
_TRANSFORMERS_READS = {"t5", "t5encoder", "umt5", "stablelm", "gpt-oss", "gpt_oss", "lfm2", "minimax-m2", "gemma4"}
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_TEXT_ONLY = {"gemma3": "gemma3_text"}  # the file holds the text backbone of a multimodal model


def gguf_config(header: GGUFHeader):
    """The transformers config the file loads as, from its metadata table alone (no tensor is read).

    transformers' GGUF key table names the config field of each metadata key; the rest follows its loader:
    tied embeddings when there is no ``output.weight``, the vocabulary size from the token list.
    """
    from transformers import AutoConfig
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = header.architecture
    named_mistral = arch == "llama" and "mistral" in str(header.metadata.get("general.name", "")).lower()
    model_type = "mistral" if named_mistral else _RENAMED.get(arch, arch)
    if arch in _TRANSFORMERS_READS or model_type not in GGUF_CONFIG_MAPPING:
        try:
            return AutoConfig.from_pretrained(header.path.parent, gguf_file=header.path.name)
        except (OSError, ValueError) as err:
            raise _bad(header.path, f"transformers cannot build a config from it ({str(err).splitlines()[0]})") from None
    sections = {arch: GGUF_CONFIG_MAPPING[model_type], "tokenizer": GGUF_CONFIG_MAPPING.get("tokenizer", {})}
    values: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type) or {})
    values["tie_word_embeddings"] = arch in ("falcon", "bloom") or "output.weight" not in header.tensors
    for key, value in header.metadata.items():
        prefix, _, rest = key.partition(".")
        field = sections.get(prefix, {}).get(rest)
        if field in (None, -1) or isinstance(value, _Skipped):
            continue
        values[field] = value[0] if isinstance(value, list) and len(value) == 1 else value
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in values and tokens is not None:
        values["vocab_size"] = len(tokens)
    return AutoConfig.for_model(_TEXT_ONLY.get(model_type, model_type), **values)
