#!/usr/bin/env bash
# Builds Strata (installing its build dependencies first if they are missing) and runs it:
#   ./scripts/run.sh blob put --verify /usr/share/doc
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-build-deps.sh
exec cargo run --release --quiet -- "$@"
