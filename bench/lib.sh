# bench/lib.sh: what the timing scripts here (cold_miss.sh, cold_floor.sh, level2_read.sh)
# share; sourced, not run. `bench_setup NAME TREE` sets:
#   bin    the strata binary: STRATA_BIN, or target/release/strata of $CARGO_TARGET_DIR
#   tree   TREE, or the Debian minbase root of scripts/debian-base.sh when TREE is empty
#   work   a fresh directory /var/tmp/strata-NAME.XXXXXX; STRATA_HOME is in it
#   store  the `--store` arguments of its local store
# and removes at exit whatever the script made: its daemon (`$daemon`), mount and
# directory, and the process in `$tracer` if the script started one.
# Then `start_daemon [ARGS]` starts a node daemon on `$work/run` (no access traces) and waits
# until it answers (a mount sent before would start a second daemon), `stop_daemon` stops
# it, `mount_layer REF` mounts REF at `$work/mnt`, `tenth_list` writes every 10th file of
# the tree (name order) to `$work/list`, and `drop_caches` syncs and drops the page cache.

bench_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
daemon=""
tracer=""

bench_setup() {
    bin="${STRATA_BIN:-${CARGO_TARGET_DIR:-/var/cache/strata/target}/release/strata}"
    tree="${2:-$("$bench_here/scripts/debian-base.sh")}"
    work="$(mktemp -d "/var/tmp/strata-$1.XXXXXX")"
    trap bench_cleanup EXIT
    export STRATA_HOME="$work/home"
    store=(--store "$work/store")
    mkdir -p "$work/mnt"
}

stop_daemon() {
    if [[ -n "$daemon" ]]; then
        kill "$daemon" 2>/dev/null || true
        wait "$daemon" 2>/dev/null || true
        daemon=""
    fi
}

bench_cleanup() {
    if [[ -n "$tracer" ]]; then kill "$tracer" 2>/dev/null || true; fi
    "$bin" "${store[@]}" umount --run-dir "$work/run" "$work/mnt" >/dev/null 2>&1 || true
    stop_daemon
    umount -l "$work/mnt" 2>/dev/null || true
    umount -l "$work/run/blobs" 2>/dev/null || true
    rm -rf "$work"
}

start_daemon() {
    "$bin" "${store[@]}" daemon --run-dir "$work/run" --trace-window 0 "$@" >>"$work/daemon.log" 2>&1 &
    daemon=$!
    for _ in $(seq 200); do
        "$bin" "${store[@]}" status --run-dir "$work/run" >/dev/null 2>&1 && return 0
        kill -0 "$daemon" 2>/dev/null || { cat "$work/daemon.log" >&2; exit 1; }
        sleep 0.05
    done
    echo "the daemon did not answer: $work/daemon.log" >&2
    exit 1
}

mount_layer() {
    "$bin" "${store[@]}" mount --run-dir "$work/run" "$1" "$work/mnt" >/dev/null
}

tenth_list() {
    (cd "$tree" && find . -type f | LC_ALL=C sort | awk 'NR % 10 == 1') >"$work/list"
}

drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
}
