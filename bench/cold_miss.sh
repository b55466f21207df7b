#!/usr/bin/env bash
# cold_miss.sh [TREE]: where a cold small-file read's time goes. Builds TREE (default: the
# Debian minbase root of scripts/debian-base.sh) as a layer into a fresh local store, starts a
# fresh node daemon (no access traces), mounts the layer, drops the page cache, reads every
# 10th file (name order) with cat, and prints the wall time and the daemon's cache counters:
# misses, backend requests and their summed latency, and the read and fetch latency
# histograms (bucket i counts operations that took < 2^i µs). Run as root; STRATA_BIN picks the
# binary (default: target/release/strata of $CARGO_TARGET_DIR); PERF_CMD profiles the daemon
# during the read, e.g. PERF_CMD="perf record -F 4999 -g -o /tmp/perf.data" (the script
# appends `-p <daemon pid>`). COLD_LIST names a file of paths (relative to TREE, one per line)
# to read instead of every 10th file. Also prints the daemon's CPU time during the read.
# Everything it made goes at the end, also when it fails.
# Figures: bench/README.md, "peers".
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bench_setup cold-miss "${1:-}"
"$bin" "${store[@]}" layer build "$tree" --name base/cold:1 --quiet >/dev/null
start_daemon
mount_layer base/cold:1
if [[ -n "${COLD_LIST:-}" ]]; then cp "$COLD_LIST" "$work/list"; else tenth_list; fi
drop_caches
[[ -n "${PERF_CMD:-}" ]] && { $PERF_CMD -p $daemon & pp=$!; sleep 1; }
cpu() { awk '{print $14 + $15}' "/proc/$daemon/stat"; }
cpu0=$(cpu)
start=$(date +%s.%N)
(cd "$work/mnt" && xargs -d '\n' -a "$work/list" cat >/dev/null)
end=$(date +%s.%N)
cpu1=$(cpu)
[[ -n "${PERF_CMD:-}" ]] && { kill -INT $pp; wait $pp || true; }
echo "cold read of $(wc -l <"$work/list") files: $(echo "$end - $start" | bc) s"
echo "daemon CPU during it: $(echo "scale=3; ($cpu1 - $cpu0) / $(getconf CLK_TCK)" | bc) s"
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
