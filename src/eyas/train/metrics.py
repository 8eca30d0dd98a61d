"""A training run's log: metrics.jsonl (one JSON line per step, the record) and TensorBoard scalars (a convenience)."""

from __future__ import annotations

import json
from pathlib import Path

from eyas.outputs import writing


class Metrics:
    """metrics.jsonl (one JSON line per step) and TensorBoard scalars."""

    def __init__(self, out: Path, keep_up_to: int):
        self.path = path = out / "metrics.jsonl"
        self.lines: list[dict] = []  # what earlier segments logged, up to the checkpoint this one resumes from
        if path.is_file():  # drop what a killed run logged after its last checkpoint (all of it when it left none)
            self.lines = [record for record in map(_record, path.read_text(encoding="utf-8", errors="replace").splitlines())
                          if record is not None and record["step"] <= keep_up_to]
            path.write_text("".join(json.dumps(record) + "\n" for record in self.lines), encoding="utf-8")
        self.file = open(path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # noqa: BLE001 — TensorBoard is a convenience; metrics.jsonl is the record
            self.board = None

    def write(self, record: dict) -> None:
        with writing(self.path, "the checkpoints written are intact: free space, then the same command with --resume "
                     "continues from the last one"):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is None:
            return
        step = record["step"]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            if key in record:
                self.board.add_scalar(f"train/{key}", record[key], step)
        for k, acc in enumerate(record.get("accuracy", [])):
            self.board.add_scalar(f"train/accuracy_step{k}", acc, step)
        for key in ("loss", "tau", "tau_answer_start"):
            if key in record.get("eval", {}):
                self.board.add_scalar(f"eval/{key}", record["eval"][key], step)
        for temperature, tau in record.get("eval", {}).get("tau_at_temperature", {}).items():
            self.board.add_scalar(f"eval/tau_T{temperature}", tau, step)
        for row in record.get("eval", {}).get("predicted", []):  # --predict: the τ bench will measure
            self.board.add_scalar(f"predicted/{row['dataset']}/{row['mode']}_T{row['temperature']:g}_"
                                  f"{row['max_new_tokens']}", row["tau"], step)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _record(line: str) -> dict | None:
    """A metrics.jsonl line as the record it holds, or None for one that holds none: blank, or cut short or damaged
    (a line is a log of a step, not the state training resumes from: that is the checkpoint's)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and type(record.get("step")) is int else None
