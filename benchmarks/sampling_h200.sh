#!/usr/bin/env bash
# A drafter's sampled rounds on one H200 (the sampling issue): the old rule (the drafter's argmax or top-k, accepted with
# the target's probability) beside the new ones (a chain's drafts drawn from the drafter: "drawn"; block verification:
# "block"), each temperature one `eyas bench` run, so every rule's τ and tokens/s sit beside the same plain baseline.
#
#   benchmarks/sampling_h200.sh DRAFT_DIR DATA_DIR [PROMPTS] [MAX_NEW_TOKENS]
#
# On the device machine, from the repository root, with eyas importable and the demo target staged (../shared/DEVICE.md).
# TEMPERATURES (default "0 1 0.7"), MODES (default chain:5,tree:60,7,10), TOP_P (1), BENCH_FLAGS (e.g. --compile),
# LIMIT: seconds per temperature (default 600; a bench stopped by it reports the prompts it measured).
# Reports and logs go to WORK (default ~/sampling) and come back as $OUT/sampling.tar.gz; each table is printed.
set -uo pipefail
draft=$1 data=$2 prompts=${3:-10} tokens=${4:-256}
TARGET=${TARGET:-~/stage/smollm2.gguf}
WORK=${WORK:-~/sampling}
mkdir -p "$WORK"
for temperature in ${TEMPERATURES:-0 1 0.7}; do
  # shellcheck disable=SC2086  # BENCH_FLAGS: several words
  timeout -s TERM "${LIMIT:-600}" python3 -m eyas bench --target "$TARGET" --draft "$draft" --data "$data" --out "$WORK/t$temperature" \
    --dataset mt-bench,humaneval,sharegpt-holdout --mode "${MODES:-chain:5,tree:60,7,10}" --prompts "$prompts" \
    --max-new-tokens "$tokens" --temperature "$temperature" --top-p "${TOP_P:-1}" \
    --draft-sampling greedy,probabilistic --verification standard,block --force ${BENCH_FLAGS:-} 2>&1 \
    | tr '\r' '\n' | grep -v 'prompt/min' > "$WORK/bench-t$temperature.log"
  echo "T = $temperature: rc=${PIPESTATUS[0]}"
  grep -h 'running eagerly' "$WORK/bench-t$temperature.log" | head -2  # a step that could not be recorded
  sed -n '/^| dataset/,/^$/p' "$WORK/t$temperature/report.md" 2>/dev/null || tail -5 "$WORK/bench-t$temperature.log"
  [ -n "${OUT:-}" ] && tar -C "$(dirname "$WORK")" -czf "$OUT/sampling.tar.gz" "$(basename "$WORK")"
done
