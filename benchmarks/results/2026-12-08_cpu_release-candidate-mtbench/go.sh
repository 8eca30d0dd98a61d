#!/usr/bin/env bash
# CPU: the release candidate and the release, MT-bench, chain:5 at T = 0 and 1, 10 prompts, 256 tokens, fp32
cd /work/main
for d in smollm2-135m-eagle3-mix smollm2-135m-eagle3; do
  OMP_NUM_THREADS=2 .venv/bin/eyas bench --target demo --draft releases/$d --data .stage/rel/data/mix-all --dataset mt-bench \
    --mode chain:5 --temperature 0,1 --prompts 10 --max-new-tokens 256 --dtype fp32 --out /tmp/b46/$d
  echo "$d rc=$?"
done
