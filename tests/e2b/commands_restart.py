"""Commands outlive the daemon, through the unmodified SDK: phase `start` starts two commands
in the background (a long one streaming lines, a short one); the daemon is killed with
SIGKILL between phases (the short one ends while no daemon runs); phase `middle` finds the
long one listed with the same pid and reads some of its output through `connect`; phase
`end` connects to both by pid and gets every line the long one wrote after the connect, in
order, and both exact exit codes."""

import json
import os
import sys

from e2b import CommandExitException, Sandbox
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]
state = os.path.join(os.environ["STRATA_TEST_DIR"], "commands-restart.json")
LINES = 100


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def lines_in_order(out, what):
    got = [l for l in out.splitlines() if l]
    nums = [int(l[1:]) for l in got]
    check(all(l.startswith("a") for l in got), f"{what}: only the command's lines")
    check(nums == list(range(nums[0], nums[0] + len(nums))) if nums else True,
          f"{what}: {len(nums)} lines, consecutive, in order")
    return nums


def finish(h):
    try:
        return h.wait()
    except CommandExitException as e:
        return e


phase = sys.argv[1]
if phase == "start":
    sb = Sandbox.create(TEMPLATE, timeout=300)
    # What the commands run is read once now: while no daemon runs, a read of a layer page
    # not yet in the page cache waits for the next daemon.
    check(sb.commands.run("sleep 0.1; echo warm").stdout == "warm\n", "warm")
    long = sb.commands.run(
        f"i=0; while [ $i -lt {LINES} ]; do echo a$i; i=$((i+1)); sleep 0.1; done; exit 3",
        background=True,
    )
    short = sb.commands.run("sleep 1; echo short; exit 5", background=True)
    json.dump({"id": sb.sandbox_id, "long": long.pid, "short": short.pid}, open(state, "w"))
    check(long.pid != short.pid, "two pids")
elif phase == "middle":
    s = json.load(open(state))
    sb = Sandbox.connect(s["id"])
    pids = {p.pid: p for p in sb.commands.list()}
    check(s["long"] in pids, "the long command is listed with its pid after a kill -9")
    check("while" in " ".join([pids[s["long"]].cmd] + pids[s["long"]].args), "with its command")
    check(s["short"] not in pids, "the short one, ended while no daemon ran, is not running")
else:
    s = json.load(open(state))
    sb = Sandbox.connect(s["id"])
    r = finish(sb.commands.connect(s["long"]))
    check(r.exit_code == 3, f"the long command's exit code: {r.exit_code}")
    nums = lines_in_order(r.stdout, "after the reconnect")
    check(nums and nums[-1] == LINES - 1, "to its last line")
    check(sb.commands.run("echo ok").stdout == "ok\n", "a new command runs")
    r = finish(sb.commands.connect(s["short"]))
    check(r.exit_code == 5, f"the short command's exit code, ended while no daemon ran: {r.exit_code}")
    sb.kill()
all_ok()
