#!/usr/bin/env bash
# The engine issue's measurements on one H200 (issue 42): do the compiled and lean rounds choose the eager round's
# drafts, how fast is each variant, and what does `eyas bench` with no speed flags reach.
#
#   benchmarks/engine_defaults_h200.sh STEP [STEP ...]     (from the repository root on the device machine)
#
# with eyas importable (PYTHONPATH=src:~/site), TARGET (default ~/stage/smollm2.gguf), DRAFT (default
# ~/stage/draft: releases/smollm2-135m-eagle3 carried), PROMPTS (5) and TOKENS (512); each STEP logs to $OUT/STEP.log:
#   agreement  benchmarks/round_agreement.py: teacher-forced rounds of compile+lean, unrounded+lean (a plain
#              torch.compile) and lean against the eager round (the model's forward), chain:5 and tree:60,7,10
#   speed      benchmarks/engine_speed.py --variants ${SPEED_VARIANTS:-graphs,compile+lean} --repeats 2 (bf16), chain:5,tree:60,7,10
#   fp32       the same in fp32, compile+lean only: trees still equal plain decoding
#   bench      `eyas bench` with no speed flags on the same prompts and modes (T = 0 and T = 1, its defaults)
#   kernels    engine_speed.py --kernels on compile+lean tree:60,7,10: the round's kernels and its launch vs GPU time
#   cuts       engine_speed.py on tree:60,7,10, variants ${CUT_VARIANTS:-compile+lean+sort,compile+lean,compile+lean+combo}:
#              the round's cost before and after a cut (+sort: proposals chosen by a sort, as before; +combo: inductor's
#              combo kernels)
#   wide       τ of graphs and compile+lean over ${WIDE_PROMPTS:-30} prompts × ${WIDE_TOKENS:-256} tokens (repeats 1): does the
#              gap between the variants' τ on 5 prompts hold over more answers, or is it which answers they took
set -uo pipefail
TARGET=${TARGET:-~/stage/smollm2.gguf}
DRAFT=${DRAFT:-~/stage/draft}
PROMPTS=${PROMPTS:-5}
TOKENS=${TOKENS:-512}
OUT=${OUT:-/tmp/out}
MODES=${MODES:-chain:5,tree:60,7,10}
export PYTHONUNBUFFERED=1
for step in "$@"; do
  began=$(date +%s)
  case $step in
    agreement) python3 benchmarks/round_agreement.py --target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" \
                 --answer-tokens "$TOKENS" --stride "${STRIDE:-8}" --modes "$MODES" \
                 --variants "${VARIANTS:-compile+lean,unrounded+lean,lean}" --out "$OUT/agreement.json" ;;
    speed) python3 benchmarks/engine_speed.py --target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" \
             --max-new-tokens "$TOKENS" --variants ${SPEED_VARIANTS:-graphs,compile+lean} --repeats 2 --modes "$MODES" --no-transformers \
             --out "$OUT/speed.json" ;;
    fp32) python3 benchmarks/engine_speed.py --target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" \
            --max-new-tokens "$TOKENS" --variants compile+lean --dtype fp32 --modes tree:60,7,10 --no-transformers \
            --out "$OUT/fp32.json" ;;
    bench) python3 -m eyas bench --target "$TARGET" --draft "$DRAFT" --dataset mt-bench --prompts "$PROMPTS" \
             --max-new-tokens "$TOKENS" --mode "$MODES" --out /tmp/bench --force \
             && cp /tmp/bench/report.json "$OUT/bench_report.json" && cp /tmp/bench/report.md "$OUT/bench_report.md" ;;
    kernels) python3 benchmarks/engine_speed.py --target "$TARGET" --draft "$DRAFT" --prompts 2 \
               --max-new-tokens "$TOKENS" --variants compile+lean --modes tree:60,7,10 --no-transformers --kernels \
               --out "$OUT/kernels/kernels.json" ;;
    cuts) python3 benchmarks/engine_speed.py --target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" \
            --max-new-tokens "$TOKENS" --variants "${CUT_VARIANTS:-compile+lean+sort,compile+lean,compile+lean+combo}" \
            --modes tree:60,7,10 --no-transformers --out "$OUT/cuts.json" ;;
    wide) python3 benchmarks/engine_speed.py --target "$TARGET" --draft "$DRAFT" --prompts "${WIDE_PROMPTS:-30}" \
            --max-new-tokens "${WIDE_TOKENS:-256}" --variants graphs,compile+lean --modes "$MODES" --no-transformers \
            --out "$OUT/wide.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac > "$OUT/$step.log" 2>&1
  echo "$step: rc $? in $(( $(date +%s) - began )) s"
  grep -v -i "warn\|it/s\]" "$OUT/$step.log" | tail -${TAIL:-12}
done
