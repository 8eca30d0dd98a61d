#!/usr/bin/env bash
# The same engine_speed.py command on two commits, one after the other on one machine, then each decoder's
# ratio after/before and both τ: how a change to the engine moves its speed.
#
#   benchmarks/engine_before_after.sh BEFORE_TREE TARGET DRAFT_DIR OUT_DIR
#
# BEFORE_TREE: a copy of the earlier commit's src/ and benchmarks/ (here: `git archive REV src benchmarks |
# tar -x -C .stage/before`); the current tree is the "after". Both run
#   engine_speed.py --target TARGET --draft DRAFT_DIR --prompts 5 --max-new-tokens 512 --variants compile+lean
#                   --repeats 2 --modes chain:5,tree:48,6,8 --no-transformers
# (override with ENGINE_SPEED_ARGS). Set BEFORE_COMMIT and EYAS_COMMIT to record both commits. Needs a GPU;
# extra Python paths (e.g. wheels installed with --target) come in through EXTRA_PYTHONPATH.
set -euo pipefail
before=$1 target=$2 draft=$3 out=$4
args=${ENGINE_SPEED_ARGS:---prompts 5 --max-new-tokens 512 --variants compile+lean --repeats 2 --modes chain:5,tree:48,6,8 --no-transformers}
after=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
# shellcheck disable=SC2086
(cd "$before" && EYAS_COMMIT=${BEFORE_COMMIT:-before} PYTHONPATH="src${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" PYTHONUNBUFFERED=1 \
  python3 benchmarks/engine_speed.py --target "$target" --draft "$draft" $args --out "$out/before.json") 2>&1 | tee "$out/before.log"
# shellcheck disable=SC2086
(cd "$after" && PYTHONPATH="src${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" PYTHONUNBUFFERED=1 \
  python3 benchmarks/engine_speed.py --target "$target" --draft "$draft" $args --out "$out/after.json") 2>&1 | tee "$out/after.log"
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
before, after = (json.loads((out / f"{name}.json").read_text())["results"] for name in ("before", "after"))
print(f"{'decoder':<30} {'before tok/s':>12} {'after tok/s':>12} {'after/before':>12}  τ before / after")
for name, b in before.items():
    a = after.get(name)
    if a is None:
        continue
    tau = f"{b['tau']:.3f} / {a['tau']:.3f}" if "tau" in b else "—"
    print(f"{name:<30} {b['tokens_per_second']:12.1f} {a['tokens_per_second']:12.1f} "
          f"{a['tokens_per_second'] / b['tokens_per_second']:12.3f}  {tau}")
PY
