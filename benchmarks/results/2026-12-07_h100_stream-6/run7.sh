#!/usr/bin/env bash
# the twenty-first session: the CompileGate (f8c381e) measured
# the thread with the trainer on a stream of the highest priority
set -u
cd ~/eyas
export PYTHONPATH=~/eyas/src:~/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
D=~/rel/data/t0-2k
mkdir -p ~/res ~/w
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== stream $(date -u +%T)"
  OUT=~/res RUNS="${RUNS:-offline streamed threaded threaded-priority}" bash benchmarks/stream_gpu.sh $D 80 32768 bf16 2>&1 | tail -n 20
  echo "== done $(date -u +%T)"; } > ~/res/driver.log 2>&1
touch ~/res/DONE
T=$(cat ~/target_path)
echo "== trace $(date -u +%T)" >> ~/res/driver.log
timeout 150 python3 benchmarks/stream_trace_gpu.py --from-step 30 --steps 5 --out ~/res/trace -- train --data $D --stream \
  --stream-producer thread --stream-dtype bf16 --target $T --out ~/w/tr --max-steps 40 --token-budget 32768 \
  --checkpoint-every 40 --keep 1 --eval-batches 10 > ~/res/trace.log 2>&1
rm -f ~/res/trace/trace.json; tail -40 ~/res/trace.log >> ~/res/driver.log; echo "== end $(date -u +%T)" >> ~/res/driver.log
