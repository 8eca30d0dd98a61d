#!/usr/bin/env bash
# Issue 46, Build 3: a release candidate trained like the release on the greedy + sampled mix (mix-all), one GPU.
#   go.sh stage              call 1, carry .stage/g/gguf.part.aa .stage/t46m .stage/r46
#   go.sh train STEPS WAIT   call 2, carry .stage/g/gguf.part.ab .stage/whl .stage/r46: join the target, start the run, wait
#   go.sh wait WAIT          later calls, carry .stage/r46
#   go.sh finish             export bf16, pack into $OUT/mix-rc (parts + records.tar.gz), no benches
set -u
export PYTHONPATH=$PWD/src:$HOME/site PYTHONUNBUFFERED=1 TARGET=$HOME/stage/smollm2.gguf WORK=$HOME/rel
NAME=${NAME:-mix-rc}
case $1 in
  stage)
    mkdir -p ~/stage ~/site $WORK/data && cp .stage/g/gguf.part.aa ~/stage/ && cp -r .stage/t46m/mix-all $WORK/data/
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    ls ~/stage $WORK/data; du -sh $WORK/data/mix-all ;;
  train)
    [ -f ~/stage/gguf.part.aa ] || { echo "staging lost"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site .stage/whl/*.whl 2>&1 | tail -2
    cat ~/stage/gguf.part.aa .stage/g/gguf.part.ab > $TARGET
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $TARGET" | sha256sum -c || exit 4
    git log -1 --format=%H 2>/dev/null; date -u
    bash benchmarks/release_h200.sh start $NAME mix-all --token-budget ${BUDGET:-32768} --attention split \
      --max-steps "$2" --checkpoint-every 250 --eval-batches 25 \
      --predict mt-bench,humaneval,sharegpt-holdout --predict-prompts 10 --predict-tokens 256,512 --predict-samples 3
    bash benchmarks/release_h200.sh wait "${3:-480}" $NAME
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  wait)
    [ -f $TARGET ] || { echo "staging lost"; exit 3; }
    bash benchmarks/release_h200.sh wait "${2:-540}" $NAME; tail -c 3000 $WORK/logs/train-$NAME.log | tr '\r' '\n' | tail -25 ;;
  finish)
    [ -f $TARGET ] || { echo "staging lost"; exit 3; }
    tr '\r' '\n' < $WORK/logs/train-$NAME.log | grep -v 'it/s\]\|^train:' | tail -40
    BENCHES="" bash benchmarks/release_h200.sh finish $NAME mix-all
    ls -la $OUT/$NAME ;;
esac
