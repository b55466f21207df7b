#!/usr/bin/env bash
# The README's main command: build a lazy layer from a real directory into the embedded store,
# mount it lazily through the node daemon, read part of it, and print the bytes fetched from
# the store against the size of the image. At the end it stops its daemon, removes the layer
# it built and its scratch directory (the layer's blobs stay in the store until a later
# `strata gc`, whose one-hour grace protects concurrent pushes). Run as root:
#   ./scripts/demo.sh [DIR]        (default: /usr/share)
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${1:-/usr/share}"
if [ "$(id -u)" != 0 ]; then
    echo "demo.sh: run as root (the daemon mounts filesystems)" >&2
    exit 1
fi
if [ -n "${STRATA_BIN:-}" ]; then
    BIN="$STRATA_BIN"   # an already built strata (e.g. a debug build)
else
    ./scripts/install-build-deps.sh
    cargo build --release --quiet
    BIN="${CARGO_TARGET_DIR:-$PWD/target}/release/strata"
fi

WORK="$(mktemp -d /tmp/strata-demo.XXXXXX)"
export STRATA_RUN_DIR="$WORK/run"      # a private daemon, stopped at the end
export STRATA_CACHE_DIR="$WORK/cache"  # a cold cache, so every byte read is fetched
MNT="$WORK/mnt"
mkdir -p "$MNT"
REF="base/demo:$(date +%Y%m%d%H%M%S)"
cleanup() {
    "$BIN" umount "$MNT" >/dev/null 2>&1 || true
    if [ -f "$STRATA_RUN_DIR/strata.pid" ]; then
        pid="$(cat "$STRATA_RUN_DIR/strata.pid")"
        kill -TERM "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    "$BIN" layer rm "$REF" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

num() { grep -o "\"$1\": [0-9]*" | head -n 1 | awk '{print $2}'; }
echo "== strata layer build $SRC --name $REF (into the embedded store)"
BUILT="$("$BIN" --json layer build "$SRC" --name "$REF")"
META=$(echo "$BUILT" | num meta_bytes)
BLOB=$(echo "$BUILT" | num blob_bytes)
TAILS=$(echo "$BUILT" | num tails_bytes)
TAILS=${TAILS:-0}
FILES=$(echo "$BUILT" | num files)
echo "   $FILES files: meta image $META bytes + data blob $BLOB bytes (whole 256 KiB chunks)" \
  "+ tails blob $TAILS bytes (small files and file tails, 16 KiB chunks)"

echo "== strata mount $REF $MNT (starts the daemon; fetches the meta image only)"
"$BIN" mount "$REF" "$MNT"
AFTER_MOUNT=$("$BIN" --json status | num bytes_fetched)
echo "   bytes fetched by the mount: $AFTER_MOUNT"

find "$MNT" -type f > "$WORK/files"
ALL=$(wc -l < "$WORK/files")
echo "== reading the first tenth of the $ALL files (directory by directory)"
READ=$(head -n $((ALL / 10 + 1)) "$WORK/files" | tr '\n' '\0' | xargs -0 cat | wc -c)
STATUS="$("$BIN" --json status)"
FETCHED=$(echo "$STATUS" | num bytes_fetched)
TOTAL=$((META + BLOB + TAILS))
echo "   read $READ bytes"
echo
echo "bytes fetched: $FETCHED of a $TOTAL-byte image ($(awk -v f="$FETCHED" -v t="$TOTAL" 'BEGIN { printf "%.1f", 100 * f / t }')%), for $READ bytes read ($(awk -v f="$FETCHED" -v r="$READ" 'BEGIN { printf "%.2f", (r ? f / r : 0) }')x); meta image $META bytes fetched whole at mount"
echo
"$BIN" status
