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
# 3. `eyas train --stream --stream-producer process` STEPS steps from DATA_DIR with the same seed, budget and dtype (the
#    same batches), the producer a process on the same GPU; the filesystem's free bytes before and after, and the run's size;
# 4. the same with `--stream-producer thread` (the producer a thread of the trainer's process); again with Python's
#    thread switch interval at SWITCH_S (default 0.0005 s; Python's own is 0.005 s): a trainer thread that wants the GIL
#    while the producer thread runs Python waits up to one interval, and its GPU may idle meanwhile; again with the
#    trainer's kernels on a CUDA stream of the highest priority (threaded-priority: the capture's kernels fill what the
#    training leaves); and again with --no-compile-layers (the capture's HF forward eager, as before --compile-layers);
# 5. `eyas train --online` the same steps (the target in the trainer, each batch captured before its step: no overlap);
# then one table: tokens/s of each (the trainer's own count over its steps' time; and over the second half of the steps,
# compile warm-ups excluded), the seconds each waited for its data, the GPU's utilisation once warm (nvidia-smi, the
# share of time some kernel ran), the ratios to offline, the disk each used; the streamed log ends with the producer's
# line (its capture time and its wait for room in the buffer).
# RUNS (environment) names the runs to make, offline among them (default: all seven above; the capture always).
# TARGET (environment) is the target (default ~/stage/smollm2.gguf); a device call that cannot carry the GGUF as well
# takes a stand-in of its architecture (benchmarks/random_target.py: the shape carried, random weights drawn there):
# its throughputs are the target's, its losses and acceptances noise.
# Results under $OUT/stream (the runs' metrics.jsonl and report.json, the logs, util-*.csv, summary.json). On the device
# machine $OUT is emptied at each call: a run that outlives its call writes under another OUT and copies it back.
set -uo pipefail
DATA=$1 STEPS=$2 BUDGET=${3:-32768} DTYPE=${4:-bf16}
SWITCH_S=${SWITCH_S:-0.0005}
TARGET=${TARGET:-~/stage/smollm2.gguf}
WORK=${WORK:-~/stream-bench}
RESULTS=${OUT:-.}/stream
mkdir -p "$WORK" "$RESULTS"
ALL="offline streamed threaded threaded-switch threaded-priority threaded-eager online"
RUNS=${RUNS:-$ALL}  # a shorter list when device time is short
for run in $RUNS; do case " $ALL " in *" $run "*) ;; *) echo "RUNS: no run named $run (the runs: $ALL)" >&2; exit 2 ;; esac; done
case " $RUNS " in *" offline "*) ;; *) echo "RUNS must hold offline: every ratio's ground" >&2; exit 2 ;; esac
RUNS=$(for run in $ALL; do case " $RUNS " in *" $run "*) printf '%s ' "$run" ;; esac; done)  # in ALL's order: offline first
for run in features $ALL; do rm -rf "${WORK:?}/$run"; done
COMMON=(--target "$TARGET" --max-steps "$STEPS" --token-budget "$BUDGET" --checkpoint-every "$STEPS" --keep 1
        --eval-batches 10)
free() { df -B1 --output=avail "$WORK" | tail -n 1; }

sampled() {  # PHASE CMD...: CMD (unless PHASE is a run RUNS leaves out), its output in $RESULTS/PHASE.log; the GPU's utilisation every 200 ms meanwhile in
  # $RESULTS/util-PHASE.csv (where nvidia-smi exists): the share of time some kernel ran, for the summary
  local phase=$1 sampler=; shift
  case " capture $RUNS " in *" $phase "*) ;; *) return 0 ;; esac
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 > "$RESULTS/util-$phase.csv" 2>/dev/null &
    sampler=$!
  fi
  "$@" > "$RESULTS/$phase.log" 2>&1; local rc=$?
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  [ $rc = 0 ] && return 0
  echo "$phase failed (rc $rc):"; tail -5 "$RESULTS/$phase.log"
  # the store and the offline run are every ratio's ground: without them nothing below means anything
  case $phase in capture|offline) exit 1 ;; esac
}

start=$SECONDS
sampled capture python3 -m eyas capture --target "$TARGET" --data "$DATA" --out "$WORK/features" --dtype "$DTYPE" \
  --token-budget "$BUDGET"
capture_s=$(( SECONDS - start ))
sampled offline python3 -m eyas train --features "$WORK/features" --out "$WORK/offline" "${COMMON[@]}"
before=$(free)
sampled streamed python3 -m eyas train --data "$DATA" --stream --stream-producer process --stream-dtype "$DTYPE" \
  --out "$WORK/streamed" "${COMMON[@]}"
after=$(free)
# the producer as a thread of the trainer's process (its capture on a CUDA stream of its own)
sampled threaded python3 -m eyas train --data "$DATA" --stream --stream-producer thread --stream-dtype "$DTYPE" \
  --out "$WORK/threaded" "${COMMON[@]}"
sampled threaded-switch python3 -c "import runpy, sys; sys.setswitchinterval($SWITCH_S); \
runpy.run_module('eyas', run_name='__main__', alter_sys=True)" train --data "$DATA" --stream --stream-producer thread \
  --stream-dtype "$DTYPE" --out "$WORK/threaded-switch" "${COMMON[@]}"
# the thread again with the trainer's kernels on a CUDA stream of the highest priority (the producer's has the lowest):
# where both have kernels waiting the GPU schedules the training's first, and the capture's fill what it leaves
sampled threaded-priority python3 -c "import runpy, torch; torch.cuda.set_stream(torch.cuda.Stream(priority=-1)); \
runpy.run_module('eyas', run_name='__main__', alter_sys=True)" train --data "$DATA" --stream --stream-producer thread \
  --stream-dtype "$DTYPE" --out "$WORK/threaded-priority" "${COMMON[@]}"
sampled threaded-eager python3 -m eyas train --data "$DATA" --stream --stream-producer thread --stream-dtype "$DTYPE" \
  --no-compile-layers --out "$WORK/threaded-eager" "${COMMON[@]}"
# the target inside the trainer, capturing each batch before its step (no overlap): what the stream must beat
sampled online python3 -m eyas train --data "$DATA" --online --out "$WORK/online" "${COMMON[@]}"
for run in $RUNS; do  # a run that failed has no report: the summary leaves it out
  cp "$WORK/$run/report.json" "$RESULTS/report-$run.json" 2>/dev/null
  cp "$WORK/$run/metrics.jsonl" "$RESULTS/metrics-$run.jsonl" 2>/dev/null
done
python3 - "$RESULTS" "$WORK" "$capture_s" "$before" "$after" "$SWITCH_S" "$RUNS" <<'PY'
import json, pathlib, subprocess, sys
results, work, capture_s, before, after = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
switch, runs = sys.argv[6], sys.argv[7].split()  # RUNS, offline first
size = lambda p: int(subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True).stdout.split()[0])
rows = {}
def utilisation(phase):  # the GPU's mean utilisation once warm (None: not sampled): the second half of the span from
    # the first to the last sample at ≥ 50 % — a phase's first seconds load the target (the GGUF dequantised on the CPU)
    # and compile with the GPU idle, which a share of all its samples would count as idle training
    path = results / f"util-{phase}.csv"
    samples = [float(x) for x in path.read_text().split()] if path.exists() else []
    busy = [i for i, x in enumerate(samples) if x >= 50]
    span = samples[busy[0]: busy[-1] + 1] if busy else []
    warm = span[len(span) // 2:]
    return sum(warm) / len(warm) / 100 if warm else None


for run in runs:
    if not (results / f"report-{run}.json").exists():
        continue  # the run failed (its log says why)
    report = json.loads((results / f"report-{run}.json").read_text())
    steps = [json.loads(line) for line in (results / f"metrics-{run}.jsonl").read_text().splitlines() if '"tokens_per_s"' in line]
    # the second half's rate (compile warm-ups excluded) from each step's cumulative tokens/s and tokens
    done = [(sum(s["tokens"] for s in steps[: i + 1]), s["tokens_per_s"]) for i, s in enumerate(steps)]
    (t0, r0), (t1, r1) = done[len(done) // 2], done[-1]
    rows[run] = {"tokens": report["tokens"], "seconds": report["seconds"], "tokens_per_s": report["tokens"] / report["seconds"],
                 "second_half_tokens_per_s": (t1 - t0) / (t1 / r1 - t0 / r0), "data_wait_s": steps[-1].get("data_wait_s"),
                 "gpu_utilisation": utilisation(run)}
ratio = lambda run, key: rows[run][key] / rows["offline"][key] if run in rows else None
summary = {**rows, "ratio": ratio("streamed", "tokens_per_s"),
           **{f"{run}_second_half_ratio": ratio(run, "second_half_tokens_per_s") for run in runs[1:]},
           "capture_gpu_utilisation": utilisation("capture"), "capture_seconds": capture_s,
           "store_bytes": size(work / "features")}
if "streamed" in rows:  # the disk a streamed run used: its checkpoint and final weights, against the store
    checkpoint = max((p for p in (work / "streamed" / "checkpoints").iterdir()), key=lambda p: p.name)
    shared = (work / "streamed" / "final" / "model.safetensors").stat().st_nlink > 1  # the checkpoint's file, linked
    summary.update(final_weights_bytes=size(work / "streamed" / "final"), final_weights_shared=shared,
                   streamed_disk_used_bytes=before - after,
                   streamed_run_bytes=size(work / "streamed"), one_checkpoint_bytes=size(checkpoint))
(results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print("| run | tokens | seconds | tokens/s | second half tokens/s | waited for data | GPU utilisation |\n"
      "|---|---|---|---|---|---|---|")
for run, row in rows.items():
    busy = "—" if row["gpu_utilisation"] is None else f"{row['gpu_utilisation']:.0%}"
    print(f"| {run} | {row['tokens']:,} | {row['seconds']:.1f} | {row['tokens_per_s']:,.0f} | "
          f"{row['second_half_tokens_per_s']:,.0f} | {row['data_wait_s'] or 0:.1f} s | {busy} |")
shown = lambda value: "—" if value is None else f"{value:.3f}"
print(f"/ offline, second half: streamed {shown(summary.get('streamed_second_half_ratio'))}, a producer thread "
      f"{shown(summary.get('threaded_second_half_ratio'))} (switch interval {switch} s: "
      f"{shown(summary.get('threaded-switch_second_half_ratio'))}; the trainer's stream first: "
      f"{shown(summary.get('threaded-priority_second_half_ratio'))}; its capture eager: "
      f"{shown(summary.get('threaded-eager_second_half_ratio'))}), online {shown(summary.get('online_second_half_ratio'))} (streamed over the "
      f"whole run {shown(summary['ratio'])}); capture {capture_s:.1f} s, store {summary['store_bytes']:,} B")
if "streamed" in rows:
    weights = "the checkpoint's file under a second name" if shared else "a copy"
    print(f"streamed run: disk used {summary['streamed_disk_used_bytes']:,} B, run dir {summary['streamed_run_bytes']:,} B: "
          f"one checkpoint {summary['one_checkpoint_bytes']:,} B and the final weights {summary['final_weights_bytes']:,} B "
          f"({weights})")
PY
