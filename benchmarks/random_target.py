"""A stand-in target for timing runs on the device: a target's architecture and tokenizer with seeded random weights.

Throughput depends on a model's shapes, not on its weights, and a device call's carry (64 MiB) cannot hold the demo
target's GGUF (98 MB) with anything else: two calls (the GGUF in parts, then the run) cost a second machine start,
and when machines are scarce the second call may find none. The shape (config and tokenizer, ~4 MB) travels instead,
and the weights are drawn on the device:

    python benchmarks/random_target.py shape TARGET DIR     # here: DIR/config.json and TARGET's tokenizer, no weights
    python benchmarks/random_target.py weights DIR          # there: seeded random weights beside them (bf16)

with eyas importable (PYTHONPATH=src) both times; then `--target DIR` (stream_gpu.sh: `TARGET=DIR`). TARGET is any
eyas target spec (`demo`, a .gguf, an HF directory); the weights' model class is the one eyas loads the target with
(:func:`eyas.target.loading.build_from_config`: multimodal wrappers too). For speed and memory only: the states such
a target yields are noise, so losses and acceptances mean nothing; a record made with it says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def save_shape(target: str, out: Path, trust_remote_code: bool = False) -> None:
    """TARGET's config and tokenizer into OUT (no weights)."""
    from eyas.target.loading import load_target_config, load_tokenizer

    config, source = load_target_config(target, trust_remote_code)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tokenizer = load_tokenizer(source, trust_remote_code)
    if tokenizer is None:
        raise SystemExit(f"{target}: no tokenizer to copy (eyas prepare and train read the target's)")
    tokenizer.save_pretrained(out)


def save_weights(directory: Path, seed: int = 0, dtype: str = "bfloat16", trust_remote_code: bool = False) -> None:
    """Seeded random weights for DIRECTORY's config, written beside it (refused where weights are already there)."""
    import torch

    from eyas.target.loading import build_from_config, load_target_config

    present = [name for name in WEIGHTS if (directory / name).exists()]
    if present:
        raise SystemExit(f"{directory} already holds weights ({', '.join(present)}): give a shape directory")
    config, _ = load_target_config(str(directory), trust_remote_code)
    torch.manual_seed(seed)
    build_from_config(config, trust_remote_code, dtype=getattr(torch, dtype)).save_pretrained(directory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    shape = steps.add_parser("shape", help="a target's config and tokenizer, no weights")
    shape.add_argument("target", help="an eyas target spec: demo, a .gguf file, an HF directory")
    shape.add_argument("out", type=Path)
    weights = steps.add_parser("weights", help="seeded random weights beside a shape directory's config")
    weights.add_argument("directory", type=Path)
    weights.add_argument("--seed", type=int, default=0)
    weights.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    for step in (shape, weights):
        step.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    if args.step == "shape":
        save_shape(args.target, args.out, args.trust_remote_code)
    else:
        save_weights(args.directory, args.seed, args.dtype, args.trust_remote_code)


if __name__ == "__main__":
    sys.exit(main())
