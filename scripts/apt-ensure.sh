#!/usr/bin/env bash
# apt-ensure.sh LABEL PACKAGE...: install the Debian packages among PACKAGE that are not
# installed yet (run as root); quick when all are present. LABEL names the caller in what it
# prints. Shared by install-build-deps.sh, install-test-deps.sh and build-erofs-utils.sh.
set -euo pipefail
label=$1
shift
missing=()
for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "$label: installing Debian packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
