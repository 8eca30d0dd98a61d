#!/usr/bin/env bash
# The serving bench on this machine's CPU (the serving issue): the released drafter in vLLM's CPU build, beside eyas'
# engine, and against two real `vllm serve` processes (with and without the drafter). From the repository root, with
# .venv (make venv) and .vllm-venv (make vllm-venv).
#
#   benchmarks/serving_cpu.sh engine OUT [PROMPTS] [TOKENS]   eyas bench --engine eyas,vllm (chain:3, chain:5) → OUT/engine
#   benchmarks/serving_cpu.sh server OUT [PROMPTS] [TOKENS]   two vLLM OpenAI servers (k = 3 and plain), eyas bench --server → OUT/server
#
# MT-bench and HumanEval, PROMPTS each (default 10), TOKENS new tokens (default 128), greedy, concurrency 1, 4, 16.
# DRAFT (default releases/smollm2-135m-eagle3) and TARGET (default demo) choose what is measured.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
what=${1:?engine or server}; out=${2:?OUT}; prompts=${3:-10}; tokens=${4:-128}
DRAFT=${DRAFT:-releases/smollm2-135m-eagle3}
TARGET=${TARGET:-demo}
VLLM=${VLLM_VENV:-$PWD/.vllm-venv}
export EYAS_VLLM_PYTHON=$VLLM/bin/python VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
mkdir -p "$out"
common=(--target "$TARGET" --dataset mt-bench,humaneval --prompts "$prompts" --max-new-tokens "$tokens"
        --concurrency 1,4,16 --device cpu --force)
case "$what" in
  engine)
    .venv/bin/eyas bench "${common[@]}" --draft "$DRAFT" --out "$out/engine" --engine eyas,vllm --mode chain:3,chain:5 \
      2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$out/engine.log" ;;
  server)
    model=$(.venv/bin/python -c "from eyas.target.loading import resolve_target; print(resolve_target('$TARGET'))")
    serve() {  # PORT LOG [ARGS...]: a vllm serve in the background, float32 and eager as eyas' CPU bench runs vLLM
      local port=$1 log=$2; shift 2
      # the module, not the `vllm` script: the CPU build's package is vllm-cpu, and `vllm serve` looks up the
      # metadata of a package named vllm to print its version, and fails
      "$VLLM/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --port "$port" --dtype float32 \
        --enforce-eager --max-model-len 2048 --served-model-name target "$@" > "$log" 2>&1 &
      echo $!
    }
    spec=$(serve 8100 "$out/serve-spec.log" --speculative-config \
      "{\"method\": \"eagle3\", \"model\": \"$(realpath "$DRAFT")\", \"num_speculative_tokens\": 3}")
    plain=$(serve 8101 "$out/serve-plain.log")
    trap 'kill $spec $plain 2>/dev/null; wait 2>/dev/null' EXIT
    for port in 8100 8101; do  # up within 10 minutes, or the log says why not
      for _ in $(seq 600); do curl -sf "localhost:$port/v1/models" > /dev/null && break; sleep 1; done
      curl -sf "localhost:$port/v1/models" > /dev/null || { echo "vllm serve on $port did not come up"; exit 1; }
    done
    .venv/bin/eyas bench "${common[@]}" --out "$out/server" --server http://localhost:8100 \
      --server-plain http://localhost:8101 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$out/server.log" ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
sed -n '/^## Serving engines/,$p' "$out/$what/report.md"
