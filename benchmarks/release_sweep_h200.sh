#!/usr/bin/env bash
# The release's data-scaling sweep on one H200, run beside the end of the T = 0 regeneration, in one machine lease.
#
# On the device machine, from the repository root, with eyas importable (PYTHONPATH=src:~/site), the demo target at
# ~/stage/smollm2.gguf and the two released journals unpacked under ~/j/<name>/regenerated.jsonl.xz:
#
#   benchmarks/release_sweep_h200.sh start [REGEN_SECONDS]   the whole plan below, in a session of its own (setsid)
#   benchmarks/release_sweep_h200.sh status [WAIT_SECONDS]    wait ≤ WAIT_SECONDS for the plan to end, then bring back
#                                                             (into this call's $OUT) the T = 0 journal as it stands,
#                                                             every run's metrics and the sweep's table so far
#
# The plan (each step logged to ~/rel/logs/sweep.log):
#   1. the T = 0 journal continues (benchmarks/regenerate_release.sh start, REGEN_SECONDS, batch 512, 512 tokens);
#   2. meanwhile, on the host's CPUs, the DATA_DIRs that need no new answer (release_h200.sh data): t0-2k (2,048
#      conversations × their T = 0 answer), t0-10k (the 10,240 conversations the T = 0.8 journal holds × T = 0),
#      mix-10k (the same × both answers) and t08-all (T = 0.8 answers only: the second holdout), and the first three
#      runs start training on the GPU beside the regeneration;
#   3. when the regeneration ends: t0-all (every conversation × T = 0) and mix-all (× T = 0, and T = 0.8 where the
#      T = 0.8 journal has it), and their runs;
#   4. when the five runs end: release_h200.sh compare (bf16 export, simulated τ of every run on the same two
#      holdouts, MT-bench chain:5 and tree:60,7,10 at T = 0) into ~/rel/out/compare.
# Every run: `eyas train --online`, equal steps (STEPS, default 300) × 16,384 tokens (SWEEP_FLAGS adds flags), lr and
# TTT steps at eyas' defaults; the runs share the GPU, so their tokens/s are not a speed figure.
set -uo pipefail
R=benchmarks/release_h200.sh
export WORK=${WORK:-~/rel} TARGET=${TARGET:-~/stage/smollm2.gguf}
J0=${J0:-~/j/smollm2-sharegpt-t0/regenerated.jsonl.xz}
J08=${J08:-~/j/smollm2-sharegpt-t08/regenerated.jsonl.xz}
REGEN=~/regen/$(basename "$(dirname "$J0")")  # regenerate_release.sh's DATA_DIR
LIVE=$REGEN/regenerated.jsonl  # the journal being written (complete lines are read)
RUNS="s-t0-2k s-t0-10k s-mix-10k s-t0-all s-mix-all"
LOG=$WORK/logs/sweep.log
mkdir -p "$WORK/logs" "$WORK/out"

say() { echo "$(date +%T) $*" | tee -a "$LOG"; }

train() {  # NAME LABEL: start the run and wait for its process
  # shellcheck disable=SC2086  # SWEEP_FLAGS: several words
  bash $R start "$1" "$2" --max-steps "${STEPS:-300}" --token-budget 16384 --checkpoint-every 100 ${SWEEP_FLAGS:-} \
    >> "$LOG" 2>&1
  while kill -0 "$(cat "$WORK/runs/$1.pid")" 2>/dev/null; do sleep 5; done
  say "$1 ended: $(tr '\r' '\n' < "$WORK/logs/train-$1.log" | grep -E '^trained|rror' | tail -n 1 | cut -c1-160)"
}

plan() {
  OUT=$WORK/out bash benchmarks/regenerate_release.sh start "$J0" "$TARGET" "${1:-560}" --max-new-tokens 512 \
    --batch-size 512 >> "$LOG" 2>&1
  say "regeneration started"
  (bash $R data t0-2k 2048 "$LIVE" "+$J08" >> "$LOG" 2>&1 && train s-t0-2k t0-2k) &
  (bash $R data t0-10k all "$LIVE" "+$J08" >> "$LOG" 2>&1 && train s-t0-10k t0-10k) &
  (bash $R data mix-10k all "$LIVE" "$J08" >> "$LOG" 2>&1 && train s-mix-10k mix-10k) &
  bash $R data t08-all all "$J08" >> "$LOG" 2>&1
  while kill -0 "$(cat "$REGEN/pid")" 2>/dev/null; do sleep 5; done
  say "regeneration ended: $(wc -l < "$LIVE") conversations in the journal"
  (bash $R data t0-all all "$LIVE" >> "$LOG" 2>&1 && train s-t0-all t0-all) &
  (bash $R data mix-all all "$LIVE" "?$J08" >> "$LOG" 2>&1 && train s-mix-all mix-all) &
  wait
  say "runs ended; comparing"
  # shellcheck disable=SC2086  # RUNS: several names
  OUT=$WORK/out PARALLEL=1 bash $R compare $RUNS -- t0=t0-all t08=t08-all >> "$LOG" 2>&1
  say "sweep done"
}

case "${1:-}" in
  start)
    setsid nohup bash "$0" plan "${2:-560}" > /dev/null 2>&1 < /dev/null &
    echo $! > "$WORK/sweep.pid"; echo "sweep started (pid $!); log: $LOG" ;;
  plan) plan "${2:-560}" ;;
  status)
    end=$(( $(date +%s) + ${2:-0} ))
    while kill -0 "$(cat "$WORK/sweep.pid")" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
      sleep $(( end - $(date +%s) < 60 ? (end - $(date +%s) > 0 ? end - $(date +%s) : 1) : 60 ))
      # shellcheck disable=SC2086
      echo "$(date +%T) journal $(wc -l < "$LIVE"); $(for n in $RUNS; do printf '%s: %s; ' "$n" \
        "$(tr '\r' '\n' < "$WORK/logs/train-$n.log" 2>/dev/null | grep -E '^train:' | tail -n 1 | grep -oE '[0-9]+/[0-9]+' | head -1)"; done)"
    done
    kill -0 "$(cat "$WORK/sweep.pid")" 2>/dev/null && echo "sweep still running" || echo "sweep ended"
    tail -n 25 "$LOG"
    # shellcheck disable=SC2086
    bash $R evals $RUNS
    bash benchmarks/regenerate_release.sh pack "$J0" 0 | tail -n 4
    # the small records travel as one archive (8 files come back per call)
    mkdir -p "$WORK/records"
    for n in $RUNS; do cp "$WORK/runs/$n/metrics.jsonl" "$WORK/records/metrics-$n.jsonl" 2>/dev/null; done
    for f in "$WORK"/logs/*.log; do tr '\r' '\n' < "$f" | grep -v 'it/s\]' > "$WORK/records/$(basename "$f")"; done
    cp -r "$WORK/out/compare" "$WORK/records/" 2>/dev/null
    tar -C "$WORK" -czf "$OUT/sweep-records.tar.gz" records ;;
  *) sed -n '2,26p' "$0"; exit 2 ;;
esac
