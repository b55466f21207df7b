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
# `-p <daemon pid>`); LEVEL2_BUILD_ARGS adds `layer build` options (e.g. `--compress none`).
# Everything it made goes at the end, also when it fails.
# Figures: bench/README.md, "peers".
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bench_setup level2-read "${1:-}"
largest="${2:-}"
# shellcheck disable=SC2086 # a list of options
"$bin" "${store[@]}" layer build "$tree" --name base/level2:1 --quiet ${LEVEL2_BUILD_ARGS:-} >/dev/null
if [[ "$largest" == --largest ]]; then
    (cd "$tree" && find . -type f -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2-) >"$work/list"
else
    tenth_list
fi
bytes=$(cd "$tree" && xargs -d '\n' -a "$work/list" du -cb | tail -1 | cut -f1)
start_daemon
mount_layer base/level2:1
"$bin" "${store[@]}" warm --run-dir "$work/run" base/level2:1 >/dev/null
"$bin" "${store[@]}" umount --run-dir "$work/run" "$work/mnt" >/dev/null
stop_daemon
start_daemon --no-passthrough
mount_layer base/level2:1
drop_caches
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
drop_caches
start=$(date +%s.%N)
(cd "$tree" && xargs -d '\n' -a "$work/list" cat >/dev/null)
end=$(date +%s.%N)
echo "native: $(echo "$end - $start" | bc) s"
