#!/usr/bin/env bash
# The one command that installs what the tests need and runs the whole suite:
#   ./scripts/test.sh
# It checks formatting and lints, builds every fuzz target and runs each for 10 s
# (scripts/fuzz.sh), starts one S3-compatible server (moto) on 127.0.0.1 for the run, runs
# every test of the workspace, then every bench in its smoke mode, and stops the server however
# the run ends.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-test-deps.sh

# Keep the build cache outside the clone so that a re-run does not rebuild the world.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/strata/target}"
mkdir -p "$CARGO_TARGET_DIR"
export CARGO_TERM_COLOR=never

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# A smoke run of every fuzz target (built apart, in its own cache): a target that no longer
# builds, or whose seeds or first mutations crash, fails CI.
echo "== fuzz smoke run"
./scripts/fuzz.sh 10

# One S3 server for the whole run; tests make their own buckets.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
log="$(mktemp -t strata-moto.XXXXXX.log)"
moto_server -H 127.0.0.1 -p "$port" >"$log" 2>&1 &
moto_pid=$!
cleanup() {
    kill "$moto_pid" 2>/dev/null || true
    wait "$moto_pid" 2>/dev/null || true
    rm -f "$log"
}
trap cleanup EXIT
for _ in $(seq 1 100); do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null; then
        break
    fi
    kill -0 "$moto_pid" 2>/dev/null || { cat "$log"; echo "moto_server died" >&2; exit 1; }
    sleep 0.1
done
export STRATA_TEST_S3_ENDPOINT="http://127.0.0.1:$port"
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-test}" AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-test}"
echo "== S3 test server: $STRATA_TEST_S3_ENDPOINT"

echo "== cargo test"
cargo test --workspace --locked --no-fail-fast

# Every bench once in its smoke mode (`cargo test --benches` passes no `--bench`: small sizes,
# the same steps and assertions as a full run), so that a bench that no longer runs, or whose
# checks fail, fails CI. `--workspace` keeps the dependency features of the build above;
# `--bench '*'` selects the bench targets only (`--benches` would also rerun the unit tests).
echo "== bench smoke runs"
export STRATA_BENCH_S3_ENDPOINT="$STRATA_TEST_S3_ENDPOINT"
cargo test --workspace --bench '*' --locked --no-fail-fast
