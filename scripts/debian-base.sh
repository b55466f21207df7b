#!/usr/bin/env bash
# debian-base.sh: prints the path of a real Debian 12 root (debootstrap --variant=minbase
# bookworm, ~206 MB), building it once under /var/cache/strata/debian-bookworm-minbase
# (about 30 s; later calls only print the path). The sandbox tests and benches use it as their
# base layer's tree. Run as root; needs the Debian archive (deb.debian.org) the first time.
set -euo pipefail
cache=${STRATA_BASE_CACHE:-/var/cache/strata}
root="$cache/debian-bookworm-minbase"
if [[ -f "$root.complete" && -d "$root" ]]; then
    echo "$root"
    exit 0
fi
command -v debootstrap >/dev/null || "$(dirname "$0")/apt-ensure.sh" debian-base debootstrap
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.debian-base.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "debian-base: debootstrap --variant=minbase bookworm (once, ~30 s)" >&2
debootstrap --variant=minbase bookworm "$tmp/root" http://deb.debian.org/debian >"$tmp/log" 2>&1 || {
    tail -20 "$tmp/log" >&2
    echo "debian-base: debootstrap failed" >&2
    exit 1
}
# Sockets, device nodes and the apt cache are not part of a layer.
rm -rf "$tmp/root/var/cache/apt/archives/"*.deb "$tmp/root/dev/"* 2>/dev/null || true
rm -rf "$root" "$root.complete"
mv "$tmp/root" "$root"
touch "$root.complete"
echo "$root"
