#!/usr/bin/env bash
# CPU: the release candidate and the release in vLLM's CPU build, MT-bench, chain:5 at T = 1, 10 prompts, 256 tokens, fp32
cd /work/main
for d in smollm2-135m-eagle3-mix smollm2-135m-eagle3; do
  OMP_NUM_THREADS=2 .venv/bin/eyas bench --target demo --draft releases/$d --dataset mt-bench --engine vllm \
    --vllm-python /work/wt/.vllm-venv/bin/python --mode chain:5 --temperature 1 --prompts 10 --max-new-tokens 256 \
    --dtype fp32 --concurrency 1 --out /tmp/v46/$d
  echo "$d rc=$?"
done
