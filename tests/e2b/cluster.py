"""The cluster through its fronts (`strata api`), with the unmodified async SDK.

  cluster.py burst N OUT [KILL_PID KILL_AFTER]
      N sandboxes created at once, alternately through every front of STRATA_FRONTS
      (comma-separated URLs); their ids to OUT (JSON). With KILL_PID, that process (a node
      daemon) is SIGKILLed once KILL_AFTER creates have succeeded: the burst must still
      complete. Prints creations/s and the create latency's p50/p99 as `STATS {json}`.
  cluster.py reach IDS
      Every sandbox of IDS (a file of `burst`) runs `echo` through every front.
  cluster.py list IDS
      Every front lists (paging, 100 a page) exactly the sandboxes of IDS.
"""

import asyncio
import json
import os
import signal
import sys
import time

from e2b import AsyncSandbox, SandboxQuery, SandboxState
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]
FRONTS = os.environ["STRATA_FRONTS"].split(",")
# Under a burst on a small machine a create can wait long in its node's queue.
TIMEOUT = 600


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def burst(n, out, kill_pid=None, kill_after=None):
    done = 0
    killed = False
    lat = []

    async def one(i):
        nonlocal done, killed
        url = FRONTS[i % len(FRONTS)]
        t0 = time.monotonic()
        sb = await AsyncSandbox.create(
            TEMPLATE,
            timeout=3600,
            metadata={"burst": out, "i": str(i)},
            api_url=url,
            sandbox_url=url,
            request_timeout=TIMEOUT,
        )
        lat.append(time.monotonic() - t0)
        done += 1
        if kill_pid and not killed and done >= kill_after:
            killed = True
            os.kill(kill_pid, signal.SIGKILL)
            print(f"killed node pid {kill_pid} after {done} creates", flush=True)
        return sb.sandbox_id

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    for e in errors[:5]:
        print("create failed:", repr(e), flush=True)
    check(not errors, f"{n} creates through {len(FRONTS)} fronts, {len(errors)} failed")
    ids = list(results)
    check(len(set(ids)) == n, "every id distinct")
    if kill_pid:
        check(killed, "the node was killed during the burst")
    json.dump(ids, open(out, "w"))
    stats = {
        "n": n,
        "wall_s": round(wall, 2),
        "creations_per_s": round(n / wall, 2),
        "p50_ms": round(pct(lat, 50) * 1000, 1),
        "p99_ms": round(pct(lat, 99) * 1000, 1),
        "max_ms": round(max(lat) * 1000, 1),
    }
    print("STATS " + json.dumps(stats), flush=True)


async def reach(ids_file):
    ids = json.load(open(ids_file))
    sem = asyncio.Semaphore(32)
    bad = []

    async def one(sid, url):
        async with sem:
            try:
                sb = await AsyncSandbox.connect(
                    sid, api_url=url, sandbox_url=url, request_timeout=TIMEOUT
                )
                r = await sb.commands.run(f"echo {sid}", request_timeout=TIMEOUT)
                if r.stdout != sid + "\n":
                    bad.append((sid, url, r.stdout))
            except Exception as e:  # noqa: BLE001 (reported below)
                bad.append((sid, url, repr(e)))

    t0 = time.monotonic()
    await asyncio.gather(*(one(s, u) for s in ids for u in FRONTS))
    for b in bad[:5]:
        print("unreachable:", b, flush=True)
    check(
        not bad,
        f"{len(ids)} sandboxes run a command through each of {len(FRONTS)} fronts "
        f"({time.monotonic() - t0:.1f} s), {len(bad)} failed",
    )


async def listing(ids_file):
    want = set(json.load(open(ids_file)))
    for url in FRONTS:
        # A front lists the nodes its last poll found up: a node restarted just before is
        # listed from the front's next poll on. Wait for that (15 s at most), not longer.
        t0 = time.monotonic()
        while True:
            seen = []
            pages = 0
            p = AsyncSandbox.list(
                limit=100, api_url=url, query=SandboxQuery(state=[SandboxState.RUNNING])
            )
            while p.has_next:
                items = await p.next_items()
                pages += 1
                seen.extend(s.sandbox_id for s in items)
            if set(seen) >= want or time.monotonic() - t0 > 15:
                break
            await asyncio.sleep(0.5)
        check(len(seen) == len(set(seen)), f"{url}: no sandbox listed twice")
        check(
            set(seen) >= want,
            f"{url}: all {len(want)} listed in {pages} pages ({len(seen)} in all, "
            f"after {time.monotonic() - t0:.1f} s)",
        )


def main():
    cmd = sys.argv[1]
    if cmd == "burst":
        kill = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (None, None)
        asyncio.run(burst(int(sys.argv[2]), sys.argv[3], *kill))
    elif cmd == "reach":
        asyncio.run(reach(sys.argv[2]))
    elif cmd == "list":
        asyncio.run(listing(sys.argv[2]))
    else:
        raise SystemExit(f"unknown command {cmd}")
    all_ok()


main()
