#!/usr/bin/env bash
# Issue 48's GPU measurement: training throughput streamed (`eyas train --stream`, the producer on the same GPU) against
# offline training from a store, at equal batches; and the disk a streamed run uses.
#
# On the device machine, from the repository root, with eyas importable (PYTHONPATH=src:~/site) and the demo target
# staged (../shared/DEVICE.md); DATA_DIR prepared on the CPU and carried (e.g. .stage/relwork/data/t0-all):
#
#   benchmarks/stream_gpu.sh DATA_DIR STEPS [TOKEN_BUDGET] [DTYPE]
#
# 1. `eyas capture` DATA_DIR into a store (DTYPE, default bf16; the training's TOKEN_BUDGET, default 32768, so the
#    store's batches are the training's), timed;
# 2. `eyas train` STEPS steps from the store (offline);
# 3. `eyas train --stream` STEPS steps from DATA_DIR with the same seed, budget and dtype (the same batches), the
#    producer on the same GPU; the filesystem's free bytes before and after, and the run's size;
# then one table: tokens/s of each (the trainer's own count over its steps' time; and over the second half of the steps,
# compile warm-ups excluded), the seconds each waited for its data, their ratio, the disk each used.
# Results under $OUT/stream (both runs' metrics.jsonl and report.json, the logs, summary.json).
set -uo pipefail
DATA=$1 STEPS=$2 BUDGET=${3:-32768} DTYPE=${4:-bf16}
TARGET=${TARGET:-~/stage/smollm2.gguf}
WORK=${WORK:-~/stream-bench}
RESULTS=${OUT:-.}/stream
mkdir -p "$WORK" "$RESULTS"
rm -rf "$WORK/features" "$WORK/offline" "$WORK/streamed"
COMMON=(--target "$TARGET" --max-steps "$STEPS" --token-budget "$BUDGET" --checkpoint-every "$STEPS" --keep 1
        --eval-batches 10)
free() { df -B1 --output=avail "$WORK" | tail -n 1; }

start=$SECONDS
python3 -m eyas capture --target "$TARGET" --data "$DATA" --out "$WORK/features" --dtype "$DTYPE" \
  --token-budget "$BUDGET" > "$RESULTS/capture.log" 2>&1 || { tail -5 "$RESULTS/capture.log"; exit 1; }
capture_s=$(( SECONDS - start ))
python3 -m eyas train --features "$WORK/features" --out "$WORK/offline" "${COMMON[@]}" > "$RESULTS/offline.log" 2>&1 \
  || { tail -5 "$RESULTS/offline.log"; exit 1; }
before=$(free)
python3 -m eyas train --data "$DATA" --stream --stream-dtype "$DTYPE" --out "$WORK/streamed" "${COMMON[@]}" \
  > "$RESULTS/streamed.log" 2>&1 || { tail -5 "$RESULTS/streamed.log"; exit 1; }
after=$(free)
for run in offline streamed; do
  cp "$WORK/$run/report.json" "$RESULTS/report-$run.json"; cp "$WORK/$run/metrics.jsonl" "$RESULTS/metrics-$run.jsonl"
done
python3 - "$RESULTS" "$WORK" "$capture_s" "$before" "$after" <<'PY'
import json, pathlib, subprocess, sys
results, work, capture_s, before, after = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
size = lambda p: int(subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True).stdout.split()[0])
rows = {}
for run in ("offline", "streamed"):
    report = json.loads((results / f"report-{run}.json").read_text())
    steps = [json.loads(line) for line in (results / f"metrics-{run}.jsonl").read_text().splitlines() if '"tokens_per_s"' in line]
    # the second half's rate (compile warm-ups excluded) from each step's cumulative tokens/s and tokens
    done = [(sum(s["tokens"] for s in steps[: i + 1]), s["tokens_per_s"]) for i, s in enumerate(steps)]
    (t0, r0), (t1, r1) = done[len(done) // 2], done[-1]
    rows[run] = {"tokens": report["tokens"], "seconds": report["seconds"], "tokens_per_s": report["tokens"] / report["seconds"],
                 "second_half_tokens_per_s": (t1 - t0) / (t1 / r1 - t0 / r0), "data_wait_s": steps[-1].get("data_wait_s")}
checkpoint = max((p for p in (work / "streamed" / "checkpoints").iterdir()), key=lambda p: p.name)
summary = {**rows, "ratio": rows["streamed"]["tokens_per_s"] / rows["offline"]["tokens_per_s"],
           "second_half_ratio": rows["streamed"]["second_half_tokens_per_s"] / rows["offline"]["second_half_tokens_per_s"],
           "final_weights_bytes": size(work / "streamed" / "final"),
           "capture_seconds": capture_s, "store_bytes": size(work / "features"),
           "streamed_disk_used_bytes": before - after, "streamed_run_bytes": size(work / "streamed"),
           "one_checkpoint_bytes": size(checkpoint)}
(results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"| run | tokens | seconds | tokens/s | second half tokens/s | waited for data |\n|---|---|---|---|---|---|")
for run, row in rows.items():
    print(f"| {run} | {row['tokens']:,} | {row['seconds']:.1f} | {row['tokens_per_s']:,.0f} | "
          f"{row['second_half_tokens_per_s']:,.0f} | {row['data_wait_s'] or 0:.1f} s |")
print(f"streamed / offline: {summary['ratio']:.3f} (second half {summary['second_half_ratio']:.3f}); capture "
      f"{capture_s:.1f} s, store {summary['store_bytes']:,} B; streamed run: disk used {summary['streamed_disk_used_bytes']:,} B, "
      f"run dir {summary['streamed_run_bytes']:,} B: one checkpoint {summary['one_checkpoint_bytes']:,} B and the final "
      f"weights {summary['final_weights_bytes']:,} B")
PY
