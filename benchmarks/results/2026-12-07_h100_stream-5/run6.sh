#!/usr/bin/env bash
# the twentieth session's GPU plan (issue 48): stream_gpu.sh over offline, the producer thread (FairLock, 8072057) and
# the thread with the trainer on a stream of the highest priority
set -u
cd ~/eyas
export PYTHONPATH=~/eyas/src:~/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
D=~/rel/data/t0-2k
mkdir -p ~/res ~/w
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== stream $(date -u +%T)"
  OUT=~/res RUNS="${RUNS:-offline streamed threaded threaded-switch threaded-priority}" bash benchmarks/stream_gpu.sh $D 80 32768 bf16 2>&1 | tail -n 20
  echo "== done $(date -u +%T)"; } > ~/res/driver.log 2>&1
touch ~/res/DONE
