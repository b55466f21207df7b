#!/usr/bin/env bash
# Installs the Debian packages Strata needs to build (run as root): RocksDB links Debian's
# librocksdb (see DEVELOPERS.md), whose Rust bindings need clang. Quick when all are present.
set -euo pipefail
debs=(pkg-config clang libclang-dev librocksdb-dev gcc libc6-dev)
"$(dirname "$0")/apt-ensure.sh" install-build-deps "${debs[@]}"
