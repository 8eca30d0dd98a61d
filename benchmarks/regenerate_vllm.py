"""Regeneration against a real serving engine, killed halfway and resumed.

vLLM's CPU build serves the demo target on 127.0.0.1; `eyas prepare --regenerate --server …`
regenerates N ShareGPT conversations; once half of them are journaled the run is killed with
SIGKILL, then run again. Checks: every expected conversation is in the journal exactly once, every
assistant turn is marked regenerated, and the rerun did not redo finished conversations.

    python benchmarks/regenerate_vllm.py --conversations 20 --out /tmp/regen-vllm

Needs the vLLM virtualenv (benchmarks/vllm_env.sh setup, ~3 min once). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV_SCRIPT = HERE / "vllm_env.sh"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("/tmp/eyas-regenerate-vllm"))
    args = parser.parse_args()

    from eyas.target import resolve_target

    model_dir = resolve_target("demo")
    data_dir = args.out / "data"
    if args.out.exists():
        subprocess.run(["rm", "-rf", str(args.out)], check=True)
    args.out.mkdir(parents=True)
    env = {**os.environ, "VLLM_MAX_MODEL_LEN": str(args.max_length + args.max_new_tokens + 64), "VLLM_SERVED_NAME": "demo"}
    subprocess.run(["bash", str(ENV_SCRIPT), "setup"], check=True, env=env)
    started = time.perf_counter()
    subprocess.run(["bash", str(ENV_SCRIPT), "serve", model_dir, str(args.port)], check=True, env=env)
    report: dict = {"server_ready_s": round(time.perf_counter() - started, 1)}
    try:
        command = [
            sys.executable, "-m", "eyas", "prepare", "--target", "demo", "--data", "sharegpt",
            "--limit", str(args.conversations), "--regenerate", "--server", f"http://127.0.0.1:{args.port}/v1",
            "--max-new-tokens", str(args.max_new_tokens), "--max-length", str(args.max_length),
            "--holdout", "0", "--out", str(data_dir),
        ]
        journal = data_dir / "regenerated.jsonl"
        report["first_run"] = run_and_kill(command, journal, kill_at=args.conversations // 2)
        before_rerun = journal_ids(journal)
        started = time.perf_counter()
        rerun = subprocess.run(command, capture_output=True, text=True)
        report["rerun_s"] = round(time.perf_counter() - started, 1)
        report["rerun_exit_code"] = rerun.returncode
        print(rerun.stdout[-3000:], rerun.stderr[-2000:] if rerun.returncode else "")
        report.update(check(journal, before_rerun, data_dir))
    finally:
        subprocess.run(["bash", str(ENV_SCRIPT), "stop"], env=env)
    (args.out / "regenerate_vllm.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    ok = report["rerun_exit_code"] == 0 and not report["duplicated"] and not report["missing"] and report["all_regenerated"]
    print("RESULT:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


def run_and_kill(command: list[str], journal: Path, kill_at: int) -> dict:
    """Start the run; SIGKILL its whole process group once ``kill_at`` conversations are journaled."""
    started = time.perf_counter()
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        if len(journal_ids(journal)) >= kill_at:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"killed_after_s": round(time.perf_counter() - started, 1), "journaled_at_kill": len(journal_ids(journal))}
        time.sleep(0.2)
    return {"finished_before_kill": True, "exit_code": process.returncode}


def journal_ids(journal: Path) -> list[str]:
    """Ids of the complete lines of the journal (a torn last line is not counted)."""
    if not journal.exists():
        return []
    ids = []
    for line in journal.read_text(encoding="utf-8").splitlines():
        try:
            ids.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            pass
    return ids


def check(journal: Path, before_rerun: list[str], data_dir: Path) -> dict:
    lines = [json.loads(line) for line in journal.read_text(encoding="utf-8").splitlines()]
    ids = [c["id"] for c in lines]
    manifest = json.loads((data_dir / "manifest.json").read_text())
    regen = manifest["stats"]["regeneration"]
    expected = regen["conversations_done"] + regen["conversations_resumed"]
    return {
        "journaled": len(ids),
        "expected": expected,
        "resumed_on_rerun": regen["conversations_resumed"],
        "regenerated_on_rerun": regen["conversations_done"],
        "failed": regen["conversations_failed"],
        "duplicated": sorted({i for i in ids if ids.count(i) > 1}),
        "missing": expected - len(set(ids)),
        "rerun_redid_finished": regen["conversations_resumed"] != len(before_rerun),
        "all_regenerated": all(t["regenerated"] == (t["role"] == "assistant") for c in lines for t in c["turns"]),
        "turns_regenerated": sum(t["role"] == "assistant" for c in lines for t in c["turns"]),
        "train_samples": manifest["stats"]["train_samples"],
    }


if __name__ == "__main__":
    main()
