"""A sandbox outlives the daemon: phase `before` creates one and writes a file, phase
`after` (the daemon restarted in between) connects to it by id and finds it running with its
files, its metadata and its access token."""

import os
import sys

from e2b import Sandbox
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]
state = os.path.join(os.environ["STRATA_TEST_DIR"], "restart-sandbox-id")


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


if sys.argv[1] == "before":
    sb = Sandbox.create(TEMPLATE, timeout=300, metadata={"phase": "before"})
    sb.files.write("/root/kept.txt", "still here")
    open(state, "w").write(sb.sandbox_id)
    check(sb.commands.run("cat /root/kept.txt").stdout == "still here", "written")
else:
    sid = open(state).read().strip()
    sb = Sandbox.connect(sid)
    check(sb.is_running(), "running after the restart")
    check(sb.get_info().metadata == {"phase": "before"}, "metadata kept")
    check(sb.files.read("/root/kept.txt") == "still here", "files kept")
    check(sb.commands.run("echo alive").stdout == "alive\n", "commands run")
    sb.kill()
all_ok()
