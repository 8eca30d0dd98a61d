"""Checkpoints that describe themselves and resume exactly: weights, optimizer, schedule, RNG, data position.

``RUN_DIR/checkpoints/step-00000500/`` holds ``model.safetensors`` (the drafter's trainable tensors and
its draft-vocabulary map), ``optimizer.safetensors`` (AdamW moments, RNG states) and ``state.json``
(step, data position, scheduler, optimizer hyper-parameters, drafter config). A checkpoint is
written in a temporary directory and renamed, then ``RUN_DIR/checkpoints/latest`` is replaced
atomically; a run killed at any moment resumes from the last complete one. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.io import write_json_atomic


def checkpoint_dir(run_dir: Path) -> Path:
    """Where checkpoints of a run live."""
    return Path(run_dir) / "checkpoints"


def drafter_tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's own tensors: all but a frozen (target-owned) embedding; plus d2t."""
    tensors = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()
               if not (name == "embed_tokens.weight" and not drafter.owns_embedding) and not name.startswith("rotary.")}
    tensors["d2t"] = drafter.d2t.detach().contiguous()
    return tensors


def save_checkpoint(run_dir: Path, step: int, drafter, optimizer, scheduler, position: dict, extra: dict, keep: int = 3) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep``; return its directory."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(drafter_tensors(drafter), str(tmp / "model.safetensors"))
    optimizer_tensors, groups = _flatten_optimizer(optimizer)
    optimizer_tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        optimizer_tensors["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"))
    state = {"step": step, "position": position, "scheduler": scheduler.state_dict(), "param_groups": groups, **extra}
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    write_json_atomic(root / "latest.json", {"checkpoint": final.name, "step": step})
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = checkpoint_dir(run_dir) / "latest.json"
    if not pointer.is_file():
        return None
    path = checkpoint_dir(run_dir) / json.loads(pointer.read_text())["checkpoint"]
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: Path, drafter, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG from ``path``; return its state.json."""
    tensors = load_file(str(path / "model.safetensors"))
    drafter.d2t.copy_(tensors.pop("d2t"))
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    allowed_missing = {"embed_tokens.weight"} if not drafter.owns_embedding else set()
    if unexpected or (set(missing) - allowed_missing - {k for k in missing if k.startswith("rotary.")}):
        raise ValueError(f"checkpoint {path} does not fit this drafter: missing {missing}, unexpected {unexpected}")
    state = json.loads((path / "state.json").read_text())
    saved = load_file(str(path / "optimizer.safetensors"))
    torch.set_rng_state(saved.pop("rng.torch"))
    cuda_rng = saved.pop("rng.cuda", None)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    optimizer.load_state_dict(_unflatten_optimizer(saved, state["param_groups"]))
    scheduler.load_state_dict(state["scheduler"])
    return state


def _flatten_optimizer(optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensors[f"state.{index}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors, state["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": groups}
