#!/usr/bin/env bash
# A trained drafter's measurements for its release (issue 46), in the background on one GPU, over device calls of
# ≤ 10 minutes: predicted against measured τ, then the card's benches at 512 and 256 tokens, T = 0 and T = 1.
#
# On the device machine, from the checkout, with the files benchmarks/device_payload.sh unpacked into ~/payload/tree
# (the GGUF as stage/smollm2.gguf, the bench wheels, the drafter, its run's records, its DATA_DIR):
#
#   benchmarks/release_bench_h200.sh start NAME DRAFT_DIR RUN_DIR DATA_DIR WHEELS_DIR
#       in a session of its own (setsid, so that it outlives the call): the wheels installed into ~/site, then
#       1. benchmarks/predict_vs_bench.py --predicted RUN_DIR (compiled, as training's prediction was decoded): every
#          row RUN_DIR's report predicts (its datasets, prompts, answer lengths) measured by bench's loop;
#       2. for each length of LENGTHS (default "512 256"): benchmarks/release_h200.sh bench NAME-L DRAFT_DIR with
#          BENCHES (default "t0 t1": MT-bench, HumanEval and DATA_DIR's holdout at T = 0 and at T = 1, MODES default
#          chain:5,tree:60,7,10), 10 prompts, BENCH_FLAGS (bench's defaults: compiled rounds).
#   benchmarks/release_bench_h200.sh wait SECONDS     the log's progress each minute until the work ends or SECONDS pass
#   benchmarks/release_bench_h200.sh collect NAME     $OUT/NAME: pvb.json, the logs and every bench report (one archive)
#
# Paths are the device machine's; TARGET (default ~/payload/tree/stage/smollm2.gguf), WORK (default ~/rel).
set -uo pipefail
export PYTHONPATH=$PWD/src:$HOME/site PYTHONUNBUFFERED=1
export TARGET=${TARGET:-$HOME/payload/tree/stage/smollm2.gguf} WORK=${WORK:-$HOME/rel}
LOG=$WORK/release-bench.log PID=$WORK/release-bench.pid

running() { [ -f "$PID" ] && kill -0 "$(cat "$PID")" 2>/dev/null; }

case "${1:-}" in
  start)
    name=$2 draft=$3 run=$4 data=$5 wheels=$6
    [ -f "$TARGET" ] || { echo "no target at $TARGET (benchmarks/device_payload.sh open first)"; exit 3; }
    if running; then echo "already running"; exit 0; fi
    mkdir -p "$WORK/data" ~/site "$WORK/out/$name"
    python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site "$wheels"/*.whl 2>&1 | tail -2
    label=$(basename "$data")
    ln -sfn "$(realpath "$data")" "$WORK/data/$label"  # release_h200.sh reads DATA_DIRs by label under $WORK/data
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    setsid nohup bash -c "
      date -u; git log -1 --format=%H 2>/dev/null
      python3 benchmarks/predict_vs_bench.py --target '$TARGET' --draft '$draft' --data '$data' --predicted '$run' \
        --out '$WORK/out/$name/pvb.json'
      echo \"pvb rc=\$?\"; date -u
      for length in ${LENGTHS:-512 256}; do
        OUT='$WORK/out/$name' BENCHES='${BENCHES:-t0 t1}' BENCH_FLAGS='${BENCH_FLAGS:-}' \
          bash benchmarks/release_h200.sh bench '$name'-\$length '$draft' '$label' 10 \$length
        date -u
      done
      echo 'release bench: done'" > "$LOG" 2>&1 < /dev/null &
    echo $! > "$PID"
    echo "started (pid $!): log $LOG" ;;
  wait)
    end=$(( $(date +%s) + $2 ))
    while running && [ "$(date +%s)" -lt "$end" ]; do
      sleep $(( end - $(date +%s) < 60 ? (end - $(date +%s) > 0 ? end - $(date +%s) : 1) : 60 ))
      echo "$(date +%T) $(tr '\r' '\n' < "$LOG" | grep -E 'rc=|bench|predicted|measured|%' | tail -n 1 | cut -c1-160)"
    done
    running && echo "still running" || { echo "ended"; tr '\r' '\n' < "$LOG" | grep -v 'it/s\]' | tail -n 40; } ;;
  collect)
    name=$2
    tr '\r' '\n' < "$LOG" | grep -v 'it/s\]' > "$WORK/out/$name/release-bench.log"
    mkdir -p "$OUT/$name"
    cp "$WORK/out/$name/pvb.json" "$OUT/$name/" 2>/dev/null
    tar -C "$WORK/out" -czf "$OUT/$name/records.tar.gz" "$name"
    ls -la "$OUT/$name" ;;
  *)
    sed -n '2,22p' "$0"; exit 2 ;;
esac
