"""A template with a warm pool: a create takes a ready sandbox (its id is the pool's), the
create's envVars still reach every command, and each sandbox is its own."""

import os
import time

from e2b import Sandbox
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


made = []
try:
    for i in range(3):
        t0 = time.perf_counter()
        sb = Sandbox.create(TEMPLATE, timeout=60, envs={"WHO": f"n{i}"}, metadata={"i": str(i)})
        made.append(sb)
        r = sb.commands.run("echo $WHO; cat /root/mark 2>/dev/null; echo x > /root/mark")
        print(f"create + first command: {1000 * (time.perf_counter() - t0):.0f} ms", flush=True)
        check(r.stdout == f"n{i}\n", f"[{i}] envVars reach the pooled sandbox's commands")
        check(sb.get_info().metadata == {"i": str(i)}, f"[{i}] metadata")
    check(len({s.sandbox_id for s in made}) == 3, "three different sandboxes")
    check(any(s.sandbox_id.startswith("sb-") for s in made), "taken from the pool")
finally:
    for s in made:
        s.kill()
all_ok()
