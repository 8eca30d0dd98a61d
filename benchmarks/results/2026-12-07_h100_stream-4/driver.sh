#!/usr/bin/env bash
# the nineteenth session's second GPU plan (issue 48), after the compile lock and the flash kernel at TTT step 0:
# step 0's attention against SDPA's, then stream_gpu.sh, then a trace of a producer-thread run
set -u
cd ~/eyas
export PYTHONPATH=~/eyas/src:~/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T=~/stage/smollm2.gguf D=~/rel/data/t0-2k
mkdir -p ~/res ~/w
{ echo "== step 0's attention $(date -u +%T)"
  python3 - <<'PY' 2>&1 | grep -v USDT
import torch, torch.nn.functional as F
from eyas.families.eagle3.split_attention import attend_causal
g = torch.Generator("cuda").manual_seed(0)
for b, h, t, d in [(3, 9, 700, 64), (1, 9, 2048, 64), (16, 9, 129, 64)]:
    q, k, v = (torch.randn(b, h, t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    out = attend_causal(q, k, v); grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), is_causal=True)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad.float())
    err = lambda a, r: ((a.float() - r.float()).norm() / r.float().norm()).item()
    print(f"[{b},{h},{t},{d}] rel err out {err(out, ref):.2e} dq {err(dq, rq):.2e} dk {err(dk, rk):.2e} dv {err(dv, rv):.2e}",
          "node", type(out.grad_fn).__name__)
PY
  echo "== stream $(date -u +%T)"
  OUT=~/res RUNS="offline streamed threaded online" bash benchmarks/stream_gpu.sh $D 80 32768 bf16 2>&1 | tail -n 20
  echo "== trace $(date -u +%T)"
  python3 benchmarks/stream_trace_gpu.py --from-step 30 --steps 5 --out ~/w/tr -- train --data $D --stream \
    --stream-producer thread --stream-dtype bf16 --out ~/w/thr --target $T --max-steps 40 --token-budget 32768 \
    --checkpoint-every 40 --keep 1 --eval-batches 10 > ~/res/trace-thread.log 2>&1
  echo "rc=$?"; grep -v USDT ~/res/trace-thread.log | tr '\r' '\n' | grep -v "^ *$" | tail -n 30
  cp ~/w/tr/gaps.json ~/res/gaps-thread.json; gzip -c ~/w/tr/trace.json > ~/res/trace-thread.json.gz
  echo "== done $(date -u +%T)"; } > ~/res/driver.log 2>&1
touch ~/res/DONE
