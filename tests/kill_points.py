"""Run eyas commands that SIGKILL themselves at a chosen file rename: the kill -9 half of tests/test_kill_resume.py.

``python kill_points.py SCENARIOS.json RESULTS.json``: each scenario is ``{"name", "argv", "call", "match", "nth",
"when"}``: run ``eyas ARGV`` and kill it at the ``nth`` call of ``os.<call>`` (replace or rename) whose destination's
name matches the glob ``match`` —

- ``when = "torn"``: before the rename, with every file being renamed cut to half its bytes (a write the kill cut
  short: a shard's or a checkpoint's bytes under their temporary name);
- ``when = "after"``: just after the rename (the shard or checkpoint is in place; the manifest, or latest.json, does
  not list it yet).

The library has no fault hooks: the kill points are patched in here, from the test side. Importing torch and
transformers costs seconds, so this process imports them once and forks one child per scenario; it never runs a torch
operation itself, so each child starts from clean thread pools. RESULTS.json maps each name to the child's exit status
(negative: the signal that ended it).
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import sys
import threading
from pathlib import Path


def _cut_short(path: Path) -> None:
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        os.truncate(file, file.stat().st_size // 2)


def _install(call: str, match: str, nth: int, when: str) -> None:
    real = getattr(os, call)
    seen, lock = [0], threading.Lock()  # shards are renamed by several writer threads

    def patched(src, dst, *args, **kwargs):
        if not fnmatch.fnmatch(Path(dst).name, match):
            return real(src, dst, *args, **kwargs)
        with lock:
            seen[0] += 1
            hit = seen[0] == nth
        if hit and when == "torn":
            _cut_short(Path(src))
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(src, dst, *args, **kwargs)
        if hit and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(os, call, patched)


def _run(scenario: dict) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _install(scenario["call"], scenario["match"], scenario["nth"], scenario["when"])
            from eyas.cli import app

            app(scenario["argv"], prog_name="eyas")
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        finally:
            os._exit(code)  # never return into the parent's loop
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(scenarios_path: str, results_path: str) -> None:
    import transformers  # noqa: F401 — imported once, before forking, for every child
    from transformers import LlamaForCausalLM  # noqa: F401

    import eyas.capture.stage  # noqa: F401
    import eyas.cli  # noqa: F401
    import eyas.train.trainer  # noqa: F401

    scenarios = json.loads(Path(scenarios_path).read_text())
    results = {scenario["name"]: _run(scenario) for scenario in scenarios}
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
