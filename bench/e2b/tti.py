"""Time to interactive, measured from the unmodified e2b SDK as public benchmarks do: from
`Sandbox.create()` to the first `commands.run("echo hi")` output. Sequential over N sandboxes,
then with C concurrent async clients. Prints a markdown table and one JSON line.

Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (the node), STRATA_TEMPLATE,
STRATA_BENCH_TTI_N (100), STRATA_BENCH_TTI_CONCURRENCY (64), STRATA_BENCH_TTI_CONCURRENT_N
(4 × concurrency)."""

import asyncio
import json
import os
import statistics
import sys
import time

from e2b import AsyncSandbox, Sandbox

TEMPLATE = os.environ.get("STRATA_TEMPLATE", "base")
N = int(os.environ.get("STRATA_BENCH_TTI_N", "100"))
C = int(os.environ.get("STRATA_BENCH_TTI_CONCURRENCY", "64"))
CN = int(os.environ.get("STRATA_BENCH_TTI_CONCURRENT_N", str(4 * C)))


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def row(name, xs, failed):
    ms = [x * 1000 for x in xs]
    return (
        f"| {name} | {len(xs)} | {failed} | {pct(ms, 50):.1f} | {pct(ms, 95):.1f} | "
        f"{pct(ms, 99):.1f} | {max(ms) if ms else float('nan'):.1f} |"
    )


def sequential():
    times, failed = [], 0
    for _ in range(N):
        t0 = time.perf_counter()
        sb = None
        try:
            sb = Sandbox.create(TEMPLATE, timeout=120)
            out = []
            sb.commands.run("echo hi", on_stdout=lambda s: out.append((time.perf_counter(), s)))
            if not out or out[0][1] != "hi\n":
                raise RuntimeError(f"unexpected output {out!r}")
            times.append(out[0][0] - t0)
        except Exception as e:  # counted, reported
            failed += 1
            print("failed:", type(e).__name__, e, flush=True)
        finally:
            if sb is not None:
                try:
                    sb.kill()
                except Exception:
                    pass
    return times, failed


async def concurrent():
    sem = asyncio.Semaphore(C)
    times, failed, made = [], 0, []

    async def one():
        nonlocal failed
        async with sem:
            t0 = time.perf_counter()
            try:
                sb = await AsyncSandbox.create(TEMPLATE, timeout=300)
                made.append(sb)
                first = []
                await sb.commands.run(
                    "echo hi", on_stdout=lambda s: first.append(time.perf_counter())
                )
                if not first:
                    raise RuntimeError("no output")
                times.append(first[0] - t0)
            except Exception as e:
                failed += 1
                print("failed:", type(e).__name__, e, flush=True)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(CN)))
    wall = time.perf_counter() - t0
    await asyncio.gather(*(sb.kill() for sb in made), return_exceptions=True)
    return times, failed, wall


seq, seq_failed = sequential()
conc, conc_failed, wall = asyncio.run(concurrent())
print()
print("| time to interactive (create → first output of `echo hi`) | sandboxes | failed | p50 ms | p95 ms | p99 ms | max ms |")
print("| --- | --- | --- | --- | --- | --- | --- |")
print(row("sequential, one SDK client", seq, seq_failed))
print(row(f"{C} concurrent async SDK clients", conc, conc_failed))
print(f"\nconcurrent: {CN} sandboxes in {wall:.1f} s ({CN / wall:.1f} per second)")
print(json.dumps({
    "sequential_ms": {p: round(pct(seq, p) * 1000, 1) for p in (50, 95, 99)},
    "concurrent_ms": {p: round(pct(conc, p) * 1000, 1) for p in (50, 95, 99)},
    "failed": seq_failed + conc_failed,
    "n": N, "concurrency": C, "concurrent_n": CN,
}))
failed = seq_failed + conc_failed
sys.stdout.flush()
# Out past the interpreter's finalization, as tests/e2b/finish.py explains (the SDK's HTTP
# client can abort it); a failed request fails the run (the goal is none).
os._exit(1 if failed else 0)
