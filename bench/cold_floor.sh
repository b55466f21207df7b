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
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bench_setup cold-floor "${1:-}"
"$bin" "${store[@]}" layer build "$tree" --name base/floor:1 --quiet >/dev/null
start_daemon
mount_layer base/floor:1
tenth_list
drop_caches
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
