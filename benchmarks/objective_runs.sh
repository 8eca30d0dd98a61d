#!/usr/bin/env bash
# Issue 46's objective / data table on one GPU: the variants of the EAGLE-3 recipe trained side by side at equal
# tokens (the same --max-steps and --token-budget), each evaluated by `eyas train --predict` (the τ eyas bench will
# measure on its own prompts, chain:K at T = 0 and drawn at T > 0), then laid out by benchmarks/objective_table.py.
#
# On the device machine, from the repository root, eyas importable and the target staged as for
# benchmarks/release_h200.sh (TARGET, WORK; each run is that script's `start`: setsid, resumable, its log in
# $WORK/logs/train-NAME.log). DATA_DIRs already under $WORK/data/LABEL (release_h200.sh data, or prepared elsewhere).
#
#   benchmarks/objective_runs.sh start T0_LABEL MIX_LABEL [TRAIN_FLAGS]
#       start every variant of VARIANTS (default: all below) on T0_LABEL (the mix variant on MIX_LABEL), each with
#       TRAIN_FLAGS (the equal budget: --token-budget, --max-steps, --checkpoint-every, --predict …) and its own flags.
#   benchmarks/objective_runs.sh wait SECONDS
#       release_h200.sh wait over the variants; then `records`.
#   benchmarks/objective_runs.sh records
#       $OUT/objective-records.tar.gz (each run's train_options.json, report.json, metrics.jsonl, its log without
#       progress bars) and, once every run has finished, $OUT/objective-table.md.
#
# The variants (o-NAME runs): kl = today's recipe (EAGLE-3's soft cross-entropy); lk-lambda, lk-alpha = the LK losses;
# hass = HASS's top-K term; eagle3.1 = --fc-norm --norm-output; mix = kl on MIX_LABEL (T = 0 and T = 0.8 answers);
# tttK (not in the default list) = --ttt-steps K; data-LABEL (not in the default list) = kl on $WORK/data/LABEL (another
# draft vocabulary, fewer distinct conversations over more passes: a DATA_DIR prepared so).
set -uo pipefail
WORK=${WORK:-~/rel}
R="$(dirname "$0")/release_h200.sh"
VARIANTS=${VARIANTS:-kl lk-lambda lk-alpha hass eagle3.1 mix}

flags_of() {  # VARIANT: its own train flags
  case $1 in
    kl|mix|data-*) ;;
    lk-lambda|lk-alpha|hass) echo --objective "$1" ;;
    eagle3.1) echo --fc-norm --norm-output ;;
    ttt*) echo --ttt-steps "${1#ttt}" ;;  # e.g. ttt5: the training-time test's depth
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}

records() {
  local rec=$WORK/objective-records name finished=1
  mkdir -p "$rec"
  for variant in $VARIANTS; do
    name=o-$variant; mkdir -p "$rec/$name"
    cp "$WORK/runs/$name"/{train_options.json,report.json,metrics.jsonl} "$rec/$name/" 2>/dev/null
    [ -f "$WORK/runs/$name/report.json" ] || finished=0
    tr '\r' '\n' < "$WORK/logs/train-$name.log" 2>/dev/null | grep -v 'it/s\]' > "$rec/$name/train.log"
  done
  if [ $finished = 1 ]; then
    python3 "$(dirname "$0")/objective_table.py" $(for v in $VARIANTS; do echo "$WORK/runs/o-$v"; done) \
      --out "$rec/objective-table.md"
  fi
  tar -C "$WORK" -czf "${OUT:-$WORK}/objective-records.tar.gz" objective-records
}

case "${1:-}" in
  start)
    t0=$2 mix=$3; shift 3
    for variant in $VARIANTS; do
      label=$t0; [ "$variant" = mix ] && label=$mix; [[ $variant == data-* ]] && label=${variant#data-}
      # shellcheck disable=SC2046  # a variant's flags are several words
      bash "$R" start "o-$variant" "$label" "$@" $(flags_of "$variant")
    done ;;
  wait)
    bash "$R" wait "$2" $(for v in $VARIANTS; do echo "o-$v"; done)
    records ;;
  records)
    records ;;
  *)
    sed -n '2,22p' "$0"; exit 2 ;;
esac
