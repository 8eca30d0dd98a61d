"""Checkpoints that describe themselves and resume exactly: weights, optimizer, schedule, RNG, data position.

``RUN_DIR/checkpoints/step-00000500/`` holds ``model.safetensors`` (the drafter's trainable tensors and
its draft-vocabulary map), ``optimizer.safetensors`` (AdamW moments, RNG states) and ``state.json``
(step, data position, scheduler, optimizer hyper-parameters, drafter config, and the size and SHA-256 of both
tensor files, checked before a resume loads them). A checkpoint is
written in a temporary directory and renamed, then ``RUN_DIR/checkpoints/latest`` is replaced
atomically; a run killed at any moment resumes from the last complete one. Nothing is pickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.errors import EyasError
from eyas.io import atomic_dir, file_sha256, remove_stale_temps, write_json_atomic
from eyas.manifest import file_problem
from eyas.outputs import writing

TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")  # each checkpoint's, with size and SHA-256 in state.json


def checkpoint_dir(run_dir: Path) -> Path:
    """Where checkpoints of a run live."""
    return Path(run_dir) / "checkpoints"


def is_sharded(drafter) -> bool:
    """True when FSDP2 manages the drafter's modules (its parameters are then sharded across ranks)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in drafter.modules())


def full_model_state(drafter) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0 (a collective when sharded: call it on every rank)."""
    if not is_sharded(drafter):
        return drafter.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def drafter_tensors(drafter, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The drafter's own tensors: all but a frozen (target-owned) embedding; plus an EAGLE-3 drafter's d2t."""
    state = drafter.state_dict() if state is None else state
    tensors = {name: t.detach().contiguous() for name, t in state.items()
               if not (name == "embed_tokens.weight" and not drafter.owns_embedding) and not name.startswith("rotary.")}
    if hasattr(drafter, "d2t"):  # an EAGLE-3 drafter's map from its vocabulary to the target's
        tensors["d2t"] = drafter.d2t.detach().cpu().contiguous()
    return tensors


def save_checkpoint(run_dir: Path, step: int, drafter, optimizer, scheduler, position: dict, extra: dict, keep: int = 3,
                    write: bool = True) -> Path:
    """Write checkpoint ``step`` atomically (only where ``write``; every rank must call it when the
    drafter is sharded, to gather it); keep the newest ``keep``; return its directory."""
    model_state = full_model_state(drafter)
    optimizer_state = _keyed(_full_optimizer_state(drafter, optimizer), _parameter_names(drafter, optimizer), by_name=True)
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    if not write:
        return final
    optimizer_tensors, groups = _flatten_optimizer(optimizer_state)
    optimizer_tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        optimizer_tensors["rng.cuda"] = torch.cuda.get_rng_state()
    state = {"step": step, "position": position, "scheduler": scheduler.state_dict(), "param_groups": groups, **extra}
    previous = latest_checkpoint(run_dir)
    advice = (f"the last complete checkpoint ({previous.name}) is intact: free space, then the same command with --resume "
              "continues from it" if previous else "no checkpoint was complete yet: free space, then rerun the same command")
    with writing(final, advice):  # a failed write leaves the previous checkpoint, latest.json and no temporary directory
        remove_stale_temps(root)  # what a run killed mid-checkpoint left
        with atomic_dir(final) as tmp:
            save_file(drafter_tensors(drafter, model_state), str(tmp / "model.safetensors"))
            save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"))
            state["files"] = {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
                              for name in TENSOR_FILES}
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
        write_json_atomic(root / "latest.json", {"checkpoint": final.name, "step": step})
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def run_bytes(run_dir: Path, drafter, keep: int) -> int:
    """About what a run still writes: ``keep`` + 1 checkpoints (the newest is written before the oldest goes), less what
    its checkpoints already take, the final weights, and some metrics."""
    weights = sum(p.numel() * 4 for p in drafter.trainable_parameters())  # fp32
    existing = sum(f.stat().st_size for f in checkpoint_dir(run_dir).rglob("*") if f.is_file())
    return max(0, (keep + 1) * 3 * weights - existing) + weights + 2**20  # a checkpoint: weights + AdamW's two moments


def checkpointed_weights(run_dir: Path, tensors: dict[str, torch.Tensor]) -> Path | None:
    """The newest checkpoint's ``model.safetensors`` when it holds exactly ``tensors`` (the same names, dtypes and
    values, read one tensor at a time), else None: a run that checkpointed its last step shares that file with its
    final weights instead of writing them twice."""
    from safetensors import SafetensorError, safe_open

    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    path = latest / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as saved:
            if set(saved.keys()) != set(tensors):
                return None
            for name, tensor in tensors.items():
                kept = saved.get_tensor(name)
                if kept.dtype != tensor.dtype or not torch.equal(kept, tensor.detach().cpu()):
                    return None
    except (OSError, SafetensorError):  # missing or unreadable: the final weights are written out instead
        return None
    return path


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None: the one ``latest.json`` names, else (removed by hand) the
    newest step directory with its state.json."""
    root = checkpoint_dir(run_dir)
    pointer = root / "latest.json"
    if not pointer.is_file():
        return None
    named = _pointed(pointer)
    path = root / named if named is not None else None
    if path is not None and (path / "state.json").is_file():
        return path
    complete = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())
    return complete[-1] if complete else None


def _pointed(pointer: Path) -> str | None:
    """The checkpoint ``latest.json`` names, or None when it names none that could be one (damaged by hand: written
    atomically, it is otherwise whole): the newest complete step directory is then the latest."""
    try:
        named = json.loads(pointer.read_text(encoding="utf-8")).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) and named.startswith("step-") and "/" not in named else None


def checkpoint_state(path: Path) -> dict:
    """Checkpoint ``path``'s state.json (its step, position, file records, …), or one line naming it when it is not
    what a checkpoint writes (damaged by hand, or by a disk), and what to do."""
    older = sorted(p.name for p in path.parent.glob("step-*") if (p / "state.json").is_file() and p.name < path.name)
    damaged = f"remove {path} to resume from {older[-1]}, or " if older else ""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise EyasError(f"{path / 'state.json'} cannot be read ({err}): {damaged}start over with --force") from None
    files = state.get("files", {}) if isinstance(state, dict) else None
    if not isinstance(state, dict) or type(state.get("step")) is not int or not isinstance(files, dict) or not all(
            isinstance(r, dict) and type(r.get("bytes")) is int and isinstance(r.get("sha256"), str) for r in files.values()):
        raise EyasError(f"{path / 'state.json'} is not a checkpoint's state (its step or file records are missing or "
                        f"of the wrong kind): {damaged}start over with --force")
    return state


def checkpoint_problems(path: Path) -> list[str]:
    """``"FILE: problem"`` for each tensor file of checkpoint ``path`` that is missing or not the bytes its state.json
    records (none for a checkpoint of an older eyas, which records no sizes or SHA-256)."""
    state = checkpoint_state(path)
    return [f"{name}: {problem}" for name, record in state.get("files", {}).items()
            if (problem := file_problem(path / name, record["bytes"], record["sha256"]))]


def load_checkpoint(path: Path, drafter, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG from ``path`` after checking its files; return its state.json."""
    problems = checkpoint_problems(path)
    if problems:
        older = sorted(p.name for p in path.parent.glob("step-*") if (p / "state.json").is_file() and p.name < path.name)
        fallback = f"remove it to resume from {older[-1]}, or " if older else ""
        raise EyasError(f"checkpoint {path} is damaged ({'; '.join(problems)}): {fallback}start over with --force")
    tensors = load_file(str(path / "model.safetensors"))
    if hasattr(drafter, "d2t"):
        drafter.d2t.copy_(tensors.pop("d2t"))
    state = checkpoint_state(path)
    saved = load_file(str(path / "optimizer.safetensors"))
    torch.set_rng_state(saved.pop("rng.torch"))
    cuda_rng = saved.pop("rng.cuda", None)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    # keyed by parameter name (older checkpoints: by index), whether or not the run that wrote it was sharded: a run
    # resumes on another number of processes, sharded or not
    optimizer_state = _keyed(_unflatten_optimizer(saved, state["param_groups"]), _parameter_names(drafter, optimizer),
                             by_name=is_sharded(drafter))
    if is_sharded(drafter):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        full = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(drafter, tensors, options=full)
        set_optimizer_state_dict(drafter, optimizer, optimizer_state, options=full)
    else:
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
        allowed_missing = {"embed_tokens.weight"} if not drafter.owns_embedding else set()
        if unexpected or (set(missing) - allowed_missing - {k for k in missing if k.startswith("rotary.")}):
            raise ValueError(f"checkpoint {path} does not fit this drafter: missing {missing}, unexpected {unexpected}")
        optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(state["scheduler"])
    return state


def _full_optimizer_state(drafter, optimizer) -> dict:
    if not is_sharded(drafter):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(drafter, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _parameter_names(drafter, optimizer) -> list[str]:
    """The names of the optimizer's parameters, in its order (the indices an unsharded optimizer's state uses)."""
    names = {id(param): name for name, param in drafter.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def _keyed(state: dict, names: list[str], by_name: bool) -> dict:
    """An optimizer state dict keyed by parameter name (``by_name``: what a sharded optimizer loads, and what checkpoints
    hold) or by index (what an unsharded one loads), whichever it was keyed by."""
    if "state" not in state:  # a gathered state on a rank other than 0: empty
        return state
    index = {name: i for i, name in enumerate(names)}
    key = (lambda k: names[k] if isinstance(k, int) else k) if by_name else (lambda k: index[k] if isinstance(k, str) else k)
    return {"state": {key(k): v for k, v in state["state"].items()},
            "param_groups": [{**group, "params": [key(p) for p in group["params"]]} for group in state["param_groups"]]}


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state → flat tensors ``state/<param key>/<name>`` (keys are parameter names; indices in older checkpoints)."""
    tensors = {}
    for key, values in state["state"].items():
        for name, value in values.items():
            tensors[f"state/{key}/{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors, state["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict = {}
    for key, value in tensors.items():
        _, param, name = key.split("/", 2)
        state.setdefault(int(param) if param.isdigit() else param, {})[name] = value
    return {"state": state, "param_groups": groups}
