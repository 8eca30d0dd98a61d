#!/usr/bin/env bash
# the twenty-second session: training's predicted tau against eyas bench's loop, the released drafter (issue 46)
# bash pvb.sh LIMIT   (answers, prediction and bench's loop at LIMIT tokens)
set -u
mkdir -p ~/bsite && cp -r .stage/c3/site/* ~/bsite/ 2>/dev/null; export PYTHONPATH=$PWD/src:~/site:~/bsite PYTHONUNBUFFERED=1
mkdir -p ~/draft ~/pvb
if [ ! -f ~/draft/model.safetensors ]; then
  cat ~/stage/model.part.00 ~/stage/model.part.01 .stage/c3/model.part.02 .stage/c3/model.part.03 > ~/draft/model.safetensors
  cp .stage/c3/config.json .stage/c3/manifest.json .stage/c3/README.md ~/draft/ && cp -r .stage/c3/data ~/data
fi
echo "d60676e3f26523783e5c8b40e7349f77cadce631a47d52317802e2d9975a3bbd  $HOME/draft/model.safetensors" | sha256sum -c || exit 4
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
name=pvb-$1
timeout "${LIMIT:-560}" python3 benchmarks/predict_vs_bench.py --target ~/stage/smollm2.gguf --draft ~/draft --data ~/data \
  --prompts 10 --tokens "$1" --measure "$1" --samples "${SAMPLES:-3}" --seeds "${SEEDS:-3}" --no-compile \
  --drawn "${DRAWN:-chain:5}" --answers ~/pvb/answers-$1.json --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
echo "rc=$?"; grep -v "it/s\]\|Loading\|Writing\|leaked\|skipped\|^predicted" "$OUT/$name.log" | tail -26
gzip -c ~/pvb/answers-$1.json > "$OUT/answers-$1.json.gz" 2>/dev/null; date -u
