#!/usr/bin/env bash
# issue 46: the objective / data table at equal tokens, the variants side by side on one GPU (benchmarks/objective_runs.sh).
#   bash .stage/t46g/go.sh stage1       (call 1: gguf part aa, mix-all, the benchmark packages, the gguf wheel)
#   bash .stage/t46g/go.sh stage2       (optional call: .stage/t46x, more DATA_DIRs: t0-v16k holds only its vocab and
#                                        manifest, its parquet files are t0-all's; t0-half)
#   bash .stage/t46g/go.sh start WAIT   (call 2: gguf part ab, t0-all; starts the runs; waits; records into $OUT)
#   bash .stage/t46g/go.sh wait WAIT    (later calls: progress; records into $OUT)
# env: STEPS, CKPT, BUDGET (tokens a step), SAMPLES (--predict-samples), VARIANTS
set -u
export PYTHONPATH=$PWD/src:$HOME/site PYTHONUNBUFFERED=1 TARGET=$HOME/stage/smollm2.gguf WORK=$HOME/rel
export VARIANTS=${VARIANTS:-kl lk-lambda hass eagle3.1 mix}
FLAGS="--token-budget ${BUDGET:-12288} --max-steps ${STEPS:-1000} --checkpoint-every ${CKPT:-250} --eval-batches 50
  --predict mt-bench,humaneval,sharegpt-holdout --predict-samples ${SAMPLES:-2} --predict-tokens ${PTOKENS:-256,512} --predict-prompts ${PPROMPTS:-10}"
show() {
  echo "== cuda smoke"; tail -20 ~/cu.log 2>/dev/null
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  cat $WORK/objective-records/objective-table.md 2>/dev/null
  for n in $VARIANTS; do echo "== $n"; grep -h "^| \|τ\|rror" $WORK/objective-records/o-$n/train.log 2>/dev/null | tail -14; done
}
case $1 in
  stage1)
    mkdir -p ~/stage ~/site $WORK/data && cp .stage/g46b/gguf.part.aa ~/stage/ && cp -r .stage/t46/site/* ~/site/ \
      && cp -r .stage/t46m/mix-all $WORK/data/ \
      && pip install -q --no-index --no-deps --target ~/site .stage/t46/whl/gguf-*.whl 2>&1 | tail -2
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    mkdir -p ~/cusrc && cp -r src .stage/cu ~/cusrc/ \
      && (cd ~/cusrc && PYTHONPATH=$HOME/cusrc/src:$HOME/site setsid nohup python3 cu/check.py > ~/cu.log 2>&1 < /dev/null &)
    ls -la ~/stage ~/site; df -h ~ | tail -1; sleep 20; cat ~/cu.log ;;
  stage2)
    mkdir -p $WORK/data && cp -r .stage/t46x/* $WORK/data/ && ls -la $WORK/data/* ;;
  start)
    cat ~/stage/gguf.part.aa .stage/g46b/gguf.part.ab > $TARGET
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $TARGET" | sha256sum -c || exit 4
    mkdir -p $WORK/data && cp -r .stage/t46d/t0-all $WORK/data/
    [ -d $WORK/data/t0-v16k ] && cp -n $WORK/data/t0-all/*.parquet $WORK/data/t0-v16k/
    date -u
    # shellcheck disable=SC2086
    bash benchmarks/objective_runs.sh start t0-all mix-all $FLAGS
    sleep 45; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    bash benchmarks/objective_runs.sh wait "${2:-380}"; show ;;
  wait)
    bash benchmarks/objective_runs.sh wait "${2:-300}"; show ;;
esac
