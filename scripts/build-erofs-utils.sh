#!/usr/bin/env bash
# Builds erofs-utils 1.8.x (mkfs.erofs, fsck.erofs, dump.erofs, erofsfuse) from Debian
# trixie's source package and installs it into $PREFIX, which is NOT on the default PATH:
# Debian 12's erofs-utils 1.5 stays the `fsck.erofs` everyone gets. Tests and benches look
# for the 1.8 tools in $PREFIX/bin (erofs-builder/tests/common/tools.rs).
#
# Run as root on Debian 12. Idempotent: when $PREFIX/bin/fsck.erofs exists and reports a
# 1.8.x version, it does nothing (a few milliseconds).
#
# Where the source comes from: a deb-src line for trixie in a sources file of its own
# ($APT_DIR/trixie-src.sources), used only by this script's apt calls through
# `-o Dir::Etc::SourceList=… -o Dir::Etc::SourceParts=…` with their own list directory. It is
# not in /etc/apt/sources.list.d, and it has no `deb` line, so it cannot change which binary
# packages apt installs for bookworm, nor slow down the system's `apt-get update`. The
# `.dsc` is verified by apt against trixie's signed Sources index (bookworm's
# debian-archive-keyring has trixie's keys), then unpacked with dpkg-source (Debian's
# patches applied). Build dependencies come from bookworm, by name.
set -euo pipefail

PREFIX=${STRATA_EROFS_UTILS_PREFIX:-/usr/local/lib/strata/erofs-utils-1.8}
APT_DIR=/var/lib/strata/apt-trixie-src
WANT='^fsck\.erofs.* 1\.8(\.|$)'

installed_ok() {
    [[ -x $PREFIX/bin/fsck.erofs && -x $PREFIX/bin/erofsfuse && -x $PREFIX/bin/mkfs.erofs ]] &&
        "$PREFIX/bin/fsck.erofs" -V 2>&1 | head -n1 | grep -Eq "$WANT"
}

if installed_ok; then
    echo "build-erofs-utils: $("$PREFIX/bin/fsck.erofs" -V 2>&1 | head -n1) already in $PREFIX"
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "build-erofs-utils: must run as root (apt-get, install into $PREFIX)" >&2
    exit 1
fi
started=$(date +%s)

# Build dependencies, from bookworm (what erofs-utils' configure needs for mkfs/fsck/dump and
# erofsfuse with lz4, zlib, lzma and zstd; dpkg-dev for dpkg-source).
debs=(build-essential dpkg-dev autoconf automake libtool pkg-config
    libfuse3-dev liblz4-dev liblzma-dev libzstd-dev uuid-dev zlib1g-dev)
"$(dirname "$0")/apt-ensure.sh" build-erofs-utils "${debs[@]}"

# The trixie deb-src index, in its own apt state (never seen by the system's apt).
mkdir -p "$APT_DIR/lists/partial"
cat >"$APT_DIR/trixie-src.sources" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
apt_src=(apt-get -q
    -o "Dir::Etc::SourceList=$APT_DIR/trixie-src.sources"
    -o "Dir::Etc::SourceParts=$APT_DIR/no-parts.d"
    -o "Dir::State::Lists=$APT_DIR/lists"
    -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
    -o "APT::Sandbox::User=root") # the _apt sandbox user cannot open /dev/null on some VMs
mkdir -p "$APT_DIR/no-parts.d"
echo "build-erofs-utils: fetching the trixie source index"
"${apt_src[@]}" update >/dev/null

work=$(mktemp -d /var/tmp/strata-erofs-utils.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
"${apt_src[@]}" source --download-only erofs-utils >/dev/null
dsc=$(ls ./*.dsc)
version=$(sed -n 's/^Version: //p' "$dsc")
case $version in
1.8.*) ;;
*)
    echo "build-erofs-utils: trixie has erofs-utils $version, expected 1.8.x" >&2
    exit 1
    ;;
esac
echo "build-erofs-utils: building erofs-utils $version"
# (Its warning that the .dsc's own signature cannot be checked is expected: apt has already
# checked the files' hashes against trixie's signed index.)
dpkg-source -x "$dsc" src >/dev/null 2>dpkg-source.log || { cat dpkg-source.log >&2; exit 1; }
cd src
# Upstream tarballs have no configure script: Debian's rules run autoreconf too.
autoreconf -fi >build.log 2>&1 || { cat build.log >&2; exit 1; }
./configure --prefix="$PREFIX" --enable-fuse --with-libzstd --with-liblzma \
    --disable-silent-rules >>build.log 2>&1 || { tail -n 40 build.log >&2; exit 1; }
make -j"$(nproc)" >>build.log 2>&1 || { tail -n 40 build.log >&2; exit 1; }
rm -rf "$PREFIX"
make install >>build.log 2>&1 || { tail -n 40 build.log >&2; exit 1; }
installed_ok || {
    echo "build-erofs-utils: installed, but $PREFIX/bin/fsck.erofs -V does not report 1.8" >&2
    exit 1
}
echo "build-erofs-utils: $("$PREFIX/bin/fsck.erofs" -V 2>&1 | head -n1) installed in $PREFIX ($(($(date +%s) - started)) s)"
