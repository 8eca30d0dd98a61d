#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md's "A drafter for the demo target" (issue 8), on nvidia-h200-x2.
#
# On the device, from the repository root, with eyas importable (PYTHONPATH=src:~/site) and:
#   TARGET      the demo target (default ~/stage/smollm2.gguf)
#   REGEN_DATA  DATA_DIR prepared from the target's own answers (eyas prepare --regenerate)
#   ORIG_DATA   DATA_DIR of the same conversations with ShareGPT's original answers
#   WORK        where runs, drafts and reports go (default ~/work);  LOGS  where logs go (default $WORK/logs)
#   LR          learning rate (default 3e-3, the best of the 2026-11-30 sweep; that day's runs used 5e-4)
#   BUDGET      tokens per step and GPU (default 16384);  CKPT  steps between checkpoints (default 100)
#
#   benchmarks/drafter_h200.sh ablate STEPS [PROMPTS]
#       2×2 grid on one budget: {regenerated, original} answers × {TTT 7, TTT 1}. GPU 0 trains on the
#       regenerated data, GPU 1 on the original, each TTT 7 then TTT 1, STEPS steps of 16384 tokens; each
#       drafter is exported and benched on the first PROMPTS MT-bench prompts (chain:5, tree:60,7,10, T=0).
#   benchmarks/drafter_h200.sh final STEPS [RUN_NAME]
#       the drafter: regenerated data, TTT 7, data parallel over every visible GPU (torchrun), resumable:
#       the same command continues RUN_NAME (default "final") from its last checkpoint (every CKPT steps).
#   benchmarks/drafter_h200.sh bench RUN_NAME [PROMPTS] [MAX_NEW_TOKENS]
#       export RUN_NAME; bench it on MT-bench, HumanEval and the regenerated holdout, chain:5 and
#       tree:60,7,10: T=0 on GPU 0 and T=1 on GPU 1 at the same time.
set -u
TARGET=${TARGET:-~/stage/smollm2.gguf}
WORK=${WORK:-~/work}
LOGS=${LOGS:-$WORK/logs}
LR=${LR:-3e-3}
BUDGET=${BUDGET:-16384}
CKPT=${CKPT:-100}
mkdir -p "$WORK/runs" "$WORK/drafts" "$WORK/bench" "$LOGS"

train_one() {  # GPU NAME DATA TTT STEPS
  CUDA_VISIBLE_DEVICES=$1 python3 -m eyas train --target "$TARGET" --data "$3" --online --out "$WORK/runs/$2" \
    --ttt-steps "$4" --max-steps "$5" --token-budget "$BUDGET" --lr "$LR" --checkpoint-every "$5" --resume \
    > "$LOGS/train-$2.log" 2>&1
}

bench_one() {  # GPU NAME OUT_SUFFIX DATASETS PROMPTS MAX_NEW TEMPERATURE [DATA]
  CUDA_VISIBLE_DEVICES=$1 python3 -m eyas bench --target "$TARGET" --draft "$WORK/drafts/$2" --out "$WORK/bench/$2$3" \
    --dataset "$4" --mode chain:5,tree:60,7,10 --prompts "$5" --max-new-tokens "$6" --temperature "$7" \
    ${8:+--data "$8"} > "$LOGS/bench-$2$3.log" 2>&1
}

export_one() {  # GPU NAME
  CUDA_VISIBLE_DEVICES=$1 python3 -m eyas export "$WORK/runs/$2" --out "$WORK/drafts/$2" > "$LOGS/export-$2.log" 2>&1
}

lane() {  # GPU DATA_LABEL DATA STEPS PROMPTS: TTT 7 then TTT 1 on one data set, each exported and benched
  for ttt in 7 1; do
    name="$2-ttt$ttt-$4"
    train_one "$1" "$name" "$3" "$ttt" "$4" && export_one "$1" "$name" && bench_one "$1" "$name" "" mt-bench "$5" 128 0
    echo "$name: rc=$? $(tail -n 1 "$WORK/runs/$name/metrics.jsonl" | python3 -c 'import json,sys; e=json.loads(sys.stdin.read()).get("eval",{}); print("holdout tau", round(e.get("tau",0),3))')"
  done
}

summary() {  # tau per report
  python3 - "$WORK/bench" <<'PY'
import json, pathlib, sys
for report in sorted(pathlib.Path(sys.argv[1]).glob("*/report.json")):
    rows = json.loads(report.read_text())["rows"]
    print(report.parent.name, "  ".join(f"{r['dataset']} {r['mode']} tau {r['tau']:.2f} {r['tokens_per_second']:.0f}/{r['plain_tokens_per_second']:.0f} tok/s" for r in rows))
PY
}

case "${1:-}" in
  ablate)
    lane 0 regen "$REGEN_DATA" "$2" "${3:-20}" & lane 1 orig "$ORIG_DATA" "$2" "${3:-20}" & wait
    summary ;;
  final)
    gpus=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
    run=${3:-final}
    python3 -m torch.distributed.run --nproc-per-node "$gpus" -m eyas train --target "$TARGET" --data "$REGEN_DATA" \
      --online --out "$WORK/runs/$run" --ttt-steps 7 --max-steps "$2" --token-budget "$BUDGET" --lr "$LR" \
      --checkpoint-every "$CKPT" --resume >> "$LOGS/train-$run.log" 2>&1
    echo "$run: rc=$?"; tail -n 1 "$WORK/runs/$run/metrics.jsonl" | cut -c1-400 ;;
  bench)
    export_one 0 "$2" || { echo "export failed"; exit 1; }
    sets=mt-bench,humaneval,sharegpt-holdout
    bench_one 0 "$2" -t0 "$sets" "${3:-40}" "${4:-256}" 0 "$REGEN_DATA" &
    bench_one 1 "$2" -t1 "$sets" "${3:-40}" "${4:-256}" 1 "$REGEN_DATA" & wait
    summary ;;
  *) sed -n 2,25p "$0"; exit 2 ;;
esac
