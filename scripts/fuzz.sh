#!/usr/bin/env bash
# Build every fuzz target in fuzz/ and run each for SECONDS (default 60) on its seed corpus:
#   ./scripts/fuzz.sh [SECONDS] [TARGET...]
# Installs cargo-fuzz if it is missing. The toolchain is stable: cargo-fuzz's nightly flags
# (-Zsanitizer=address, sanitizer coverage) are allowed by RUSTC_BOOTSTRAP=1. Builds go to
# $FUZZ_TARGET_DIR (default /var/cache/strata/fuzz-target), apart from the workspace's cache
# because every crate is compiled with other flags. `.cargo/config.toml` (ROCKSDB_LIB_DIR)
# applies: cargo runs inside the repository.
#
# Each target starts from fuzz/corpus/<target>/ (read only; seeds committed there) and
# writes what it finds new into a scratch corpus that is removed afterwards; a crash, a leak
# or a timeout is kept in fuzz/artifacts/<target>/ and fails the run (after every target has
# run). At the end, a table: executions and new corpus entries per target.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

secs="${1:-60}"
shift || true
case "$secs" in
    '' | *[!0-9]*) echo "usage: $0 [SECONDS] [TARGET...]" >&2; exit 2 ;;
esac

export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked --version 0.13.2
fi

export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-/var/cache/strata/fuzz-target}"
export CARGO_TERM_COLOR=never
mkdir -p "$CARGO_TARGET_DIR"

cd "$root/fuzz"
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

echo "== building ${#targets[@]} fuzz targets"
start=$(date +%s)
if [ "$#" -gt 0 ]; then
    for t in "${targets[@]}"; do cargo fuzz build "$t"; done
else
    cargo fuzz build
fi
echo "== built in $(($(date +%s) - start)) s"

bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release"
scratch=$(mktemp -d -t strata-fuzz.XXXXXX)
# The targets that build directories (level 2, uppers, state files) fsync a lot: give them a
# tmpfs where there is one, so that a run measures parsing rather than the disk.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    files=$(mktemp -d /dev/shm/strata-fuzz.XXXXXX)
else
    files="$scratch/files"
    mkdir -p "$files"
fi
trap 'rm -rf "$scratch" "$files"' EXIT

# Dictionaries of the JSON targets (field and op names).
dict_of() {
    case "$1" in
        node_state | holder_meta | node_proto | bd_descriptor | cache_stats | sandbox_request)
            echo "-dict=$root/fuzz/dicts/node_json.dict" ;;
    esac
}

failed=()
results=()
for t in "${targets[@]}"; do
    seeds="$root/fuzz/corpus/$t"
    mkdir -p "$seeds" "$scratch/$t" "$root/fuzz/artifacts/$t"
    nseeds=$(find "$seeds" -type f | wc -l)
    log="$scratch/$t.log"
    echo "== $t: ${secs} s from $nseeds seeds"
    # shellcheck disable=SC2046 # the dictionary option is one word or none
    if (cd "$scratch" && TMPDIR="$files" "$bin/$t" "$scratch/$t" "$seeds" $(dict_of "$t") \
        -max_total_time="$secs" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$root/fuzz/artifacts/$t/") >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed+=("$t")
        # The panic (or sanitizer report) and the input, without libFuzzer's stack dump.
        grep -E -A2 "panicked at|^==[0-9]+==ERROR|^SUMMARY|Test unit written|^Base64" "$log" |
            grep -v "^ *#" | head -40 || tail -40 "$log"
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    new=$(find "$scratch/$t" -type f | wc -l)
    results+=("$(printf '%-18s %12s %8s %s' "$t" "${runs:-?}" "$new" "$status")")
done

echo "== executions in ${secs} s per target"
printf '%-18s %12s %8s %s\n' target executions new result
printf '%s\n' "${results[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz targets failed: ${failed[*]} (inputs in fuzz/artifacts/<target>/)" >&2
    exit 1
fi
