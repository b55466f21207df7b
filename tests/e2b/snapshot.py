"""Filesystem snapshots and forks through the unmodified SDK, on the runtime's pack-diff:
create_snapshot (with and without a name), a sandbox created from a snapshot sees the
files, list_snapshots filters by sandbox and name, delete_snapshot forgets it, a memory
snapshot is refused with the SDK's own exception, and fork(count=3) gives three sandboxes
of their own (files carried over, writes kept apart, envVars and metadata inherited)."""

import os

from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


made = []
snaps = []
try:
    src = Sandbox.create(TEMPLATE, timeout=120, envs={"ROLE": "src"}, metadata={"job": "j1"})
    made.append(src)
    src.files.write("/srv/model/weights.txt", "w=42\n")
    src.commands.run("mkdir -p /root/.cache/pip && echo junk > /root/.cache/pip/x")
    src.commands.run("echo 'cd /srv' > /root/.bash_history")

    # A memory snapshot is not what this node takes.
    try:
        src.create_snapshot(mode="full")
        check(False, "a memory snapshot is refused")
    except (SandboxException, InvalidArgumentException) as e:
        check("filesystem" in str(e), f"a memory snapshot is refused: {e}")

    s1 = src.create_snapshot(mode="filesystem")
    snaps.append(s1.snapshot_id)
    check(s1.snapshot_id and s1.names == [], "an unnamed filesystem snapshot")
    s2 = src.create_snapshot(name="trained")
    snaps.append(s2.snapshot_id)
    check(s2.snapshot_id == "trained" and s2.names == ["trained"], "a named snapshot")
    check(src.commands.run("echo alive").stdout == "alive\n", "the source runs on after it")

    listed = [s.snapshot_id for s in src.list_snapshots().next_items()]
    check(sorted(listed) == sorted([s1.snapshot_id, "trained"]), f"listed by sandbox: {listed}")
    named = Sandbox.list_snapshots(name="trained").next_items()
    check([s.snapshot_id for s in named] == ["trained"], "listed by name")

    user = Sandbox.create(s2.snapshot_id, timeout=60)
    made.append(user)
    check(user.files.read("/srv/model/weights.txt") == "w=42\n", "a sandbox of the snapshot has its files")
    r = user.commands.run("ls /root/.cache /root/.bash_history 2>&1 || true")
    check("No such file" in r.stdout, f"residue stripped from the snapshot: {r.stdout!r}")
    ids = user.commands.run("cat /etc/machine-id").stdout
    check(ids != src.commands.run("cat /etc/machine-id").stdout, "its own machine id")

    check(Sandbox.delete_snapshot(s1.snapshot_id), "delete_snapshot")
    snaps.remove(s1.snapshot_id)
    check(not Sandbox.delete_snapshot(s1.snapshot_id), "a deleted snapshot is gone")
    left = [s.snapshot_id for s in src.list_snapshots().next_items()]
    check(left == ["trained"], f"listed after the delete: {left}")

    forks = src.fork(count=3, timeout=60)
    check(len(forks) == 3 and all(isinstance(f, Sandbox) for f in forks), f"three forks: {forks}")
    made.extend(forks)
    check(len({f.sandbox_id for f in forks} | {src.sandbox_id}) == 4, "four different sandboxes")
    for i, f in enumerate(forks):
        check(f.files.read("/srv/model/weights.txt") == "w=42\n", f"fork {i} has the files")
        f.files.write("/srv/model/weights.txt", f"w={i}\n")
        check(f.commands.run("echo $ROLE").stdout == "src\n", f"fork {i} inherits envVars")
        check(f.get_info().metadata == {"job": "j1"}, f"fork {i} inherits metadata")
    for i, f in enumerate(forks):
        check(f.files.read("/srv/model/weights.txt") == f"w={i}\n", f"fork {i} keeps its own writes")
    check(src.files.read("/srv/model/weights.txt") == "w=42\n", "the source is untouched")
    hidden = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    check(hidden == ["trained"], f"a fork's snapshot is not listed: {hidden}")
finally:
    for s in made:
        try:
            s.kill()
        except Exception as e:  # noqa: BLE001
            print("kill:", e)
    for s in snaps:
        Sandbox.delete_snapshot(s)
all_ok()
