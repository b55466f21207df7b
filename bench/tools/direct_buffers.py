#!/usr/bin/env python3
"""direct_buffers.py FILE MIB DEPTH {plain,huge}: O_DIRECT reads of FILE's first 512 MiB
(at most), MIB MiB each, DEPTH threads, into buffers of ordinary pages or of transparent huge
pages (MADV_HUGEPAGE on a private anonymous mapping). Drops the page cache first (root).
Prints GB/s. Why: an O_DIRECT read becomes one device request per `max_segments` physically
contiguous pieces of its buffer (/sys/block/DEV/queue/max_segments); see bench/README.md,
"peers", "level-2 runs in huge-page buffers"."""
import mmap
import os
import sys
import threading
import time

path, mib, depth, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
req = mib << 20
total = min(os.path.getsize(path), 512 << 20)


def buffer():
    m = mmap.mmap(-1, req + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "huge":
        m.madvise(mmap.MADV_HUGEPAGE)
    for i in range(0, len(m), 4096):
        m[i] = 1
    return m


fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
offsets = list(range(0, total, req))
lock = threading.Lock()
nxt = [0]


def worker():
    m = buffer()
    view = memoryview(m)[:req]
    while True:
        with lock:
            if nxt[0] >= len(offsets):
                return
            at = offsets[nxt[0]]
            nxt[0] += 1
        os.preadv(fd, [view], at)


with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3\n")
start = time.time()
threads = [threading.Thread(target=worker) for _ in range(depth)]
for t in threads:
    t.start()
for t in threads:
    t.join()
elapsed = time.time() - start
print(f"{mib} MiB reads, {depth} at once, {kind} pages: {total / elapsed / 1e9:.2f} GB/s")
