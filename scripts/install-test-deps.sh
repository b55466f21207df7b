#!/usr/bin/env bash
# Installs what Strata's tests need on Debian 12 (run as root): Debian packages, and from PyPI
# an S3-compatible test server (moto) and the pinned E2B Python SDK, each in its own
# virtualenv because Debian 12's system Python refuses `pip install` (PEP 668). Idempotent and
# quick when everything is present.
set -euo pipefail

"$(dirname "$0")/install-build-deps.sh"

debs=(
    erofs-utils fuse3 libfuse3-dev attr            # standard tools that judge our images
    tar gzip zstd                                  # layer tarballs for the tar-input tests
    e2fsprogs                                      # mkfs.ext4 / e2fsck on block devices
    btrfs-progs                                    # mkfs.btrfs: the sandboxes' uppers image
    python3 python3-venv                           # scripts/test.sh; the moto virtualenv
    runc                                           # sandboxes: the OCI runtime
    debootstrap                                    # the Debian base layer of the sandbox tests
    iproute2 nftables                              # sandbox networks (veth, egress allowlists)
    skopeo umoci                                   # judges of OCI export/import (tests/oci.rs)
)
"$(dirname "$0")/apt-ensure.sh" install-test-deps "${debs[@]}"

# erofs-utils 1.8 (stricter fsck.erofs, erofsfuse with --device) from Debian trixie's source
# package, into /usr/local/lib/strata/erofs-utils-1.8 (off PATH; ~40 s once, then instant).
"$(dirname "$0")/build-erofs-utils.sh"

# moto in /usr/local/lib/strata/moto, linked as /usr/local/bin/moto_server (tests start
# `moto_server` from PATH). Debian's /usr/bin/python3 is preferred so that the virtualenv does
# not depend on a pyenv or other user-installed interpreter that may come first on PATH.
moto_venv=/usr/local/lib/strata/moto
if [[ ! -x "$moto_venv/bin/moto_server" ]]; then
    py=/usr/bin/python3
    [[ -x "$py" ]] || py="$(command -v python3)"
    echo "install-test-deps: installing moto[server] (S3 test server) from PyPI into $moto_venv"
    rm -rf "$moto_venv"
    mkdir -p "$(dirname "$moto_venv")"
    "$py" -m venv "$moto_venv"
    "$moto_venv/bin/pip" install --quiet --disable-pip-version-check 'moto[server]>=5,<6'
fi
ln -sf "$moto_venv/bin/moto_server" /usr/local/bin/moto_server
hash -r
command -v moto_server >/dev/null || { echo "install-test-deps: moto_server is not on PATH after install" >&2; exit 1; }
# The unmodified E2B Python SDK, pinned, in /usr/local/lib/strata/e2b: tests/e2b.rs runs the
# scripts of tests/e2b/ with it against a node's `--api` (the version is the one whose
# protocol e2b-api implements; bump both together).
e2b_version=2.63.0
e2b_venv=/usr/local/lib/strata/e2b
if [[ "$("$e2b_venv/bin/python" -c 'import importlib.metadata as m; print(m.version("e2b"))' 2>/dev/null)" != "$e2b_version" ]]; then
    py=/usr/bin/python3
    [[ -x "$py" ]] || py="$(command -v python3)"
    echo "install-test-deps: installing e2b==$e2b_version (the E2B SDK) from PyPI into $e2b_venv"
    rm -rf "$e2b_venv"
    mkdir -p "$(dirname "$e2b_venv")"
    "$py" -m venv "$e2b_venv"
    "$e2b_venv/bin/pip" install --quiet --disable-pip-version-check "e2b==$e2b_version"
fi
# A real Debian root for the sandbox tests' base layer, built once (~30 s) and cached under
# /var/cache/strata (scripts/debian-base.sh prints its path).
"$(dirname "$0")/debian-base.sh" >/dev/null
echo "install-test-deps: ok"
