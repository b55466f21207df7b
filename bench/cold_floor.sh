#!/usr/bin/env bash
# cold_floor.sh [TREE]: the floor under a cold small-file read through a lazy mount on this
# machine. Builds TREE (default: the Debian minbase root of scripts/debian-base.sh) as a layer
# into a fresh local store, mounts it on a fresh node daemon, and records (strace) the store
# reads a cold read of every 10th file (name order) makes. Then, five times, with the page
# cache dropped before each: those store reads replayed alone in the same order (open, pread,
# fadvise DONTNEED, close: what the POSIX backend does, without FUSE, decoding or hand-offs),
# and native `cat` of the same files from TREE. What a lazy read costs beyond the first column
# is the daemon's and the kernel's work, not the disk's. Run as root; STRATA_BIN picks the
# binary (default: target/release/strata of $CARGO_TARGET_DIR). Everything it made goes at the
# end, also when it fails. Figures: bench/README.md, "peers".
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${STRATA_BIN:-${CARGO_TARGET_DIR:-/var/cache/strata/target}/release/strata}"
tree="${1:-$("$here/scripts/debian-base.sh")}"
work="$(mktemp -d /var/tmp/strata-cold-floor.XXXXXX)"
daemon=""
tracer=""
cleanup() {
    [[ -n "$tracer" ]] && kill "$tracer" 2>/dev/null || true
    "$bin" --store "$work/store" umount --run-dir "$work/run" "$work/mnt" >/dev/null 2>&1 || true
    if [[ -n "$daemon" ]]; then
        kill "$daemon" 2>/dev/null || true
        wait "$daemon" 2>/dev/null || true
    fi
    umount -l "$work/mnt" 2>/dev/null || true
    umount -l "$work/run/blobs" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
export STRATA_HOME="$work/home"
store=(--store "$work/store")
"$bin" "${store[@]}" layer build "$tree" --name base/floor:1 --quiet >/dev/null
mkdir -p "$work/mnt"
"$bin" "${store[@]}" daemon --run-dir "$work/run" --trace-window 0 >"$work/daemon.log" 2>&1 &
daemon=$!
"$bin" "${store[@]}" mount --run-dir "$work/run" base/floor:1 "$work/mnt" >/dev/null
(cd "$tree" && find . -type f | LC_ALL=C sort | awk 'NR % 10 == 1') >"$work/list"
sync
echo 3 >/proc/sys/vm/drop_caches
strace -q -f -e trace=openat2,pread64 -o "$work/trace" -p "$daemon" 2>/dev/null &
tracer=$!
sleep 1
(cd "$work/mnt" && xargs -d '\n' -a "$work/list" cat >/dev/null)
kill -INT "$tracer"
wait "$tracer" || true
tracer=""
python3 - "$work" "$tree" <<'PY'
import os, re, subprocess, sys, time
work, tree = sys.argv[1], sys.argv[2]
fd_path, reads = {}, []
for line in open(f"{work}/trace"):
    m = re.search(r'openat2\(\d+, "([^"]+)".*\) = (\d+)', line)
    if m:
        fd_path[m.group(2)] = m.group(1)
        continue
    m = re.search(r'pread64\((\d+), .*, (\d+), (\d+)\) = (\d+)', line)
    if m and fd_path.get(m.group(1), "").startswith("blobs/"):
        reads.append((fd_path[m.group(1)], int(m.group(2)), int(m.group(3))))
files = sum(1 for _ in open(f"{work}/list"))
def drop():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
for _ in range(5):
    drop()
    t = time.perf_counter()
    for path, n, off in reads:
        fd = os.open(f"{work}/store/{path}", os.O_RDONLY)
        os.pread(fd, n, off)
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    alone = time.perf_counter() - t
    drop()
    t = time.perf_counter()
    subprocess.run(["xargs", "-d", "\n", "-a", f"{work}/list", "cat"], cwd=tree,
                   stdout=subprocess.DEVNULL, check=True)
    native = time.perf_counter() - t
    print(f"store reads alone: {len(reads)} reads, {sum(r[1] for r in reads) / 1e6:.1f} MB, "
          f"{alone:.3f} s; native cat of {files} files: {native:.3f} s; alone / native {alone / native:.2f}")
PY
