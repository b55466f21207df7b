#!/usr/bin/env bash
# Installs what Strata's tests need on Debian 12 (run as root): Debian packages and an
# S3-compatible test server (moto) from PyPI, in its own virtualenv because Debian 12's system
# Python refuses `pip install` (PEP 668). Idempotent and quick when everything is present.
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
# A real Debian root for the sandbox tests' base layer, built once (~30 s) and cached under
# /var/cache/strata (scripts/debian-base.sh prints its path).
"$(dirname "$0")/debian-base.sh" >/dev/null
echo "install-test-deps: ok"
