#!/usr/bin/env bash
# Installs what Strata's tests need on Debian 12 (run as root): Debian packages and an
# S3-compatible test server from PyPI. Idempotent and quick when everything is present.
set -euo pipefail

"$(dirname "$0")/install-build-deps.sh"

debs=(
    erofs-utils fuse3 libfuse3-dev attr            # standard tools that judge our images
    tar gzip zstd                                  # layer tarballs for the tar-input tests
    e2fsprogs                                      # mkfs.ext4 / e2fsck on block devices
)
missing=()
for p in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "install-test-deps: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# erofs-utils 1.8 (stricter fsck.erofs, erofsfuse with --device) from Debian trixie's source
# package, into /usr/local/lib/strata/erofs-utils-1.8 (off PATH; ~40 s once, then instant).
"$(dirname "$0")/build-erofs-utils.sh"

if ! command -v moto_server >/dev/null 2>&1; then
    echo "install-test-deps: installing moto[server] (S3 test server) from PyPI"
    python3 -m pip install --quiet --disable-pip-version-check 'moto[server]>=5,<6'
    hash -r
fi
command -v moto_server >/dev/null || { echo "install-test-deps: moto_server is not on PATH after install" >&2; exit 1; }
echo "install-test-deps: ok"
