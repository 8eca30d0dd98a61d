#!/usr/bin/env bash
# Keep the working tree that travels to the device machine within its 64 MiB (../shared/DEVICE.md): releases/ holds
# tens of MB of journals and drafters that a GPU run rarely needs, and the demo target itself travels in ~50 MB parts.
#
#   benchmarks/device_tree.sh park      remove releases/' large files (≥ 1 MB) from the working tree; HEAD keeps them
#   benchmarks/device_tree.sh restore   put them back from HEAD (git checkout), sha256 checked against the manifest
#   benchmarks/device_tree.sh size      what would travel now (tracked and untracked-not-ignored files), in bytes
#
# park refuses while releases/ has uncommitted changes (commit first: nothing is removed that HEAD does not hold).
# A run that needs a released file carries it: copy it under .stage/ (ignored) and name that path in `carry`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
size() { { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{s += $1} END {printf "%d bytes (%.1f MiB) travel\n", s, s / 1048576}'; }
case "${1:-}" in
  park)
    if [ -n "$(git status --porcelain -- releases)" ]; then
      echo "releases/ has uncommitted changes; commit them before parking:" >&2; git status --short -- releases >&2; exit 1
    fi
    find releases -type f -size +1M -print -delete | sed 's/^/parked /'
    size ;;
  restore)
    git checkout -- releases
    (cd releases && sha256sum --quiet -c MANIFEST.sha256) && echo "releases/ restored; sha256 as in the manifest"
    size ;;
  size) size ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
