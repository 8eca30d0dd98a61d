#!/usr/bin/env bash
# the nineteenth session's GPU plan (issue 48): torch.profiler traces of a producer-thread run (compiled and eager
# capture) and of an offline run from a store, each over steps 30-34, with their idle gaps explained
set -u
cd ~/eyas
export PYTHONPATH=~/eyas/src:~/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T=~/stage/smollm2.gguf D=~/rel/data/t0-2k
COMMON="--target $T --max-steps 40 --token-budget 32768 --checkpoint-every 40 --keep 1 --eval-batches 10"
mkdir -p ~/res ~/w
nvidia-smi > ~/res/nvidia-smi.txt 2>&1
trace() { name=$1; shift
  echo "== $name $(date -u +%T)"
  python3 benchmarks/stream_trace_gpu.py --from-step 30 --steps 5 --out ~/w/tr-$name -- train "$@" > ~/res/$name.log 2>&1
  echo "rc=$?"; grep -v USDT ~/res/$name.log | tr '\r' '\n' | grep -v "^ *$" | tail -n 45
  cp ~/w/tr-$name/gaps.json ~/res/gaps-$name.json 2>/dev/null
  gzip -c ~/w/tr-$name/trace.json > ~/res/trace-$name.json.gz 2>/dev/null; }
{ trace thread --data $D --stream --stream-producer thread --stream-dtype bf16 --out ~/w/thr $COMMON
  trace thread-eager --data $D --stream --stream-producer thread --stream-dtype bf16 --no-compile-layers --out ~/w/thre $COMMON
  echo "== store $(date -u +%T)"
  python3 -m eyas capture --target $T --data $D --out ~/w/f --dtype bf16 --token-budget 32768 --max-gb 2 2>&1 | tr '\r' '\n' | tail -n 2
  trace offline --features ~/w/f --out ~/w/off $COMMON
  ls -la ~/res; echo "== done $(date -u +%T)"; } > ~/res/driver.log 2>&1
touch ~/res/DONE
