#!/usr/bin/env bash
# one device call (the gguf does not fit a call's carry): random bf16 weights of the demo target's architecture, then
# run7.sh under a deadline; whatever finished comes back
cd "$(dirname "$0")/../.." || exit 1
PYTHONPATH=src python3 benchmarks/random_target.py weights .stage/randtarget 2>&1 | grep -v USDT | tail -2
echo $PWD/.stage/randtarget > ~/target_path; mkdir -p ~/rel/data ~/eyas ~/res && cp -r .stage/relwork/data/t0-2k ~/rel/data/ && cp -r src benchmarks ~/eyas/
TARGET=$PWD/.stage/randtarget timeout "${1:-520}" bash .stage/driver/run7.sh
cat ~/res/driver.log; ls ~/res/stream
tail -n 3 ~/res/stream/*.log; grep -c "could not be compiled\|fail_on_recompile\|Traceback\|running eagerly" ~/res/stream/*.log ~/res/trace.log
(cd ~ && tar czf "$OUT/res.tgz" res $(ls stream-bench/*/metrics.jsonl stream-bench/*/report.json 2>/dev/null))
