#!/usr/bin/env bash
# Installs the Debian packages Strata needs to build (run as root): RocksDB links Debian's
# librocksdb (see DEVELOPERS.md), whose Rust bindings need clang. Quick when all are present.
set -euo pipefail
debs=(pkg-config clang libclang-dev librocksdb-dev)
missing=()
for p in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "install-build-deps: installing Debian packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
