#!/usr/bin/env bash
# cold_miss.sh [TREE]: where a cold small-file read's time goes. Builds TREE (default: the
# Debian minbase root of scripts/debian-base.sh) as a layer into a fresh local store, starts a
# fresh node daemon (no access traces), mounts the layer, drops the page cache, reads every
# 10th file (name order) with cat, and prints the wall time and the daemon's cache counters:
# misses, backend requests and their summed latency, and the read and fetch latency
# histograms (bucket i counts operations that took < 2^i µs). Run as root; STRATA_BIN picks the
# binary (default: target/release/strata of $CARGO_TARGET_DIR); PERF_CMD profiles the daemon
# during the read, e.g. PERF_CMD="perf record -F 4999 -g -o /tmp/perf.data" (the script
# appends `-p <daemon pid>`). Everything it made goes at the end, also when it fails.
# Figures: bench/README.md, "peers".
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${STRATA_BIN:-${CARGO_TARGET_DIR:-/var/cache/strata/target}/release/strata}"
tree="${1:-$("$here/scripts/debian-base.sh")}"
work="$(mktemp -d /var/tmp/strata-cold-miss.XXXXXX)"
daemon=""
cleanup() {
    "$bin" --store "$work/store" umount --run-dir "$work/run" "$work/mnt" >/dev/null 2>&1 || true
    if [[ -n "$daemon" ]]; then
        kill "$daemon" 2>/dev/null || true
        wait "$daemon" 2>/dev/null || true
    fi
    umount -l "$work/mnt" 2>/dev/null || true
    umount -l "$work/run/blobs" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
export STRATA_HOME="$work/home"
store=(--store "$work/store")
"$bin" "${store[@]}" layer build "$tree" --name base/cold:1 --quiet >/dev/null
mkdir -p "$work/mnt"
"$bin" "${store[@]}" daemon --run-dir "$work/run" --trace-window 0 >"$work/daemon.log" 2>&1 &
daemon=$!
"$bin" "${store[@]}" mount --run-dir "$work/run" base/cold:1 "$work/mnt" >/dev/null
(cd "$tree" && find . -type f | LC_ALL=C sort | awk 'NR % 10 == 1') >"$work/list"
sync
echo 3 >/proc/sys/vm/drop_caches
[[ -n "${PERF_CMD:-}" ]] && { $PERF_CMD -p $daemon & pp=$!; sleep 1; }
start=$(date +%s.%N)
(cd "$work/mnt" && xargs -d '\n' -a "$work/list" cat >/dev/null)
end=$(date +%s.%N)
[[ -n "${PERF_CMD:-}" ]] && { kill -INT $pp; wait $pp || true; }
echo "cold read of $(wc -l <"$work/list") files: $(echo "$end - $start" | bc) s"
"$bin" "${store[@]}" --json status --run-dir "$work/run" | python3 -c '
import json, sys
c = json.load(sys.stdin)["cache"]
keys = ["misses", "backend_requests", "bytes_fetched", "fetch_latency_sum_us", "hits_memory", "hits_disk"]
print({k: c[k] for k in keys})
if c["backend_requests"]:
    print("mean backend request: %.0f us" % (c["fetch_latency_sum_us"] / c["backend_requests"]))
print("read latency (< 2^i us):", c["read_latency_us"][:16])
print("fetch latency (< 2^i us):", c["fetch_latency_us"][:16])
'
