"""A command streaming through a cluster front outlives the front: phase `start` starts a
long command in the background through the front and follows its output for a while (the
stream is cut when this process exits, as the front's restart would cut it); phase `end`,
through the restarted front, connects to it by pid and gets the rest of its lines in order
and its exact exit code."""

import json
import os
import sys

from e2b import CommandExitException, Sandbox
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]
state = os.path.join(os.environ["STRATA_TEST_DIR"], "front-restart.json")
LINES = 100


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


if sys.argv[1] == "start":
    sb = Sandbox.create(TEMPLATE, timeout=300)
    check(sb.commands.run("sleep 0.1; echo warm").stdout == "warm\n", "warm")
    h = sb.commands.run(
        f"i=0; while [ $i -lt {LINES} ]; do echo b$i; i=$((i+1)); sleep 0.1; done; exit 4",
        background=True,
    )
    seen = ""
    for stdout, _, _ in h:
        seen += stdout or ""
        if seen.count("\n") >= 5:
            break
    check(seen.startswith("b0\nb1\n"), f"the first lines: {seen!r}")
    json.dump({"id": sb.sandbox_id, "pid": h.pid}, open(state, "w"))
    check(True, "followed the first lines through the front")
else:
    s = json.load(open(state))
    sb = Sandbox.connect(s["id"])
    listed = sb.commands.list()
    try:
        r = sb.commands.connect(s["pid"]).wait()
    except CommandExitException as e:
        r = e
    check(s["pid"] in [p.pid for p in listed], f"listed through the restarted front: {s} {listed}")
    check(r.exit_code == 4, f"exit code through the restarted front: {r.exit_code}")
    nums = [int(l[1:]) for l in r.stdout.splitlines() if l]
    check(nums and nums == list(range(nums[0], LINES)), f"lines {nums[:1]}..{LINES - 1} in order")
    sb.kill()
all_ok()
