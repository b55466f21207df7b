#!/usr/bin/env bash
# level2_read.sh [TREE] [--largest]: a level-2 hit read through the chunk cache against native.
# Builds TREE (default: the Debian minbase root of scripts/debian-base.sh) as a layer into a
# fresh local store, fills the node's level 2 (`strata warm`), restarts the daemon with
# `--no-passthrough` (level 1 empty, every read through the cache's FUSE blob files: what a
# layer mounted before it was wholly cached keeps), drops the page cache and reads every 10th
# file (name order) with cat — or, with --largest, the largest file — then drops the page
# cache again and reads the same files from TREE itself. Prints both wall times and the
# daemon's hit counters and read-latency histogram (bucket i: reads that took < 2^i µs).
# Run as root; STRATA_BIN picks the binary (default: target/release/strata of
# $CARGO_TARGET_DIR); PERF_CMD profiles the daemon during the read (the script appends
# `-p <daemon pid>`). Everything it made goes at the end, also when it fails.
# Figures: bench/README.md, "peers".
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${STRATA_BIN:-${CARGO_TARGET_DIR:-/var/cache/strata/target}/release/strata}"
tree="${1:-$("$here/scripts/debian-base.sh")}"
largest="${2:-}"
work="$(mktemp -d /var/tmp/strata-level2-read.XXXXXX)"
daemon=""
stop_daemon() {
    if [[ -n "$daemon" ]]; then
        kill "$daemon" 2>/dev/null || true
        wait "$daemon" 2>/dev/null || true
        daemon=""
    fi
}
cleanup() {
    "$bin" "${store[@]}" umount --run-dir "$work/run" "$work/mnt" >/dev/null 2>&1 || true
    stop_daemon
    umount -l "$work/mnt" 2>/dev/null || true
    umount -l "$work/run/blobs" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
export STRATA_HOME="$work/home"
store=(--store "$work/store")
start_daemon() {
    "$bin" "${store[@]}" daemon --run-dir "$work/run" --trace-window 0 "$@" >>"$work/daemon.log" 2>&1 &
    daemon=$!
    # Mount only once this daemon answers (a mount with no daemon would start another one).
    for _ in $(seq 200); do
        "$bin" "${store[@]}" status --run-dir "$work/run" >/dev/null 2>&1 && break
        kill -0 "$daemon" 2>/dev/null || { cat "$work/daemon.log" >&2; exit 1; }
        sleep 0.05
    done
    "$bin" "${store[@]}" mount --run-dir "$work/run" base/level2:1 "$work/mnt" >/dev/null
}
"$bin" "${store[@]}" layer build "$tree" --name base/level2:1 --quiet >/dev/null
mkdir -p "$work/mnt"
if [[ "$largest" == --largest ]]; then
    (cd "$tree" && find . -type f -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2-) >"$work/list"
else
    (cd "$tree" && find . -type f | LC_ALL=C sort | awk 'NR % 10 == 1') >"$work/list"
fi
bytes=$(cd "$tree" && xargs -d '\n' -a "$work/list" du -cb | tail -1 | cut -f1)
start_daemon
"$bin" "${store[@]}" warm --run-dir "$work/run" base/level2:1 >/dev/null
"$bin" "${store[@]}" umount --run-dir "$work/run" "$work/mnt" >/dev/null
stop_daemon
start_daemon --no-passthrough
sync
echo 3 >/proc/sys/vm/drop_caches
pp=""
if [[ -n "${PERF_CMD:-}" ]]; then
    $PERF_CMD -p "$daemon" &
    pp=$!
    sleep 1
fi
start=$(date +%s.%N)
(cd "$work/mnt" && xargs -d '\n' -a "$work/list" cat >/dev/null)
end=$(date +%s.%N)
if [[ -n "$pp" ]]; then kill -INT "$pp"; wait "$pp" || true; fi
echo "level 2 through the cache: $(wc -l <"$work/list") files, $bytes bytes: $(echo "$end - $start" | bc) s"
"$bin" "${store[@]}" --json status --run-dir "$work/run" | python3 -c '
import json, sys
c = json.load(sys.stdin)["cache"]
print({k: c[k] for k in ["misses", "hits_memory", "hits_disk", "disk_readahead_chunks", "disk_readahead_hits", "bytes_read"]})
print("read latency (< 2^i us):", c["read_latency_us"][:16])'
sync
echo 3 >/proc/sys/vm/drop_caches
start=$(date +%s.%N)
(cd "$tree" && xargs -d '\n' -a "$work/list" cat >/dev/null)
end=$(date +%s.%N)
echo "native: $(echo "$end - $start" | bc) s"
