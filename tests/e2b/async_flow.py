"""The same flow with the async SDK (AsyncSandbox), several sandboxes at once."""

import asyncio
import os

from e2b import AsyncSandbox, CommandExitException, SandboxQuery
from e2b.exceptions import FileNotFoundException
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


async def one(i: int):
    sb = await AsyncSandbox.create(TEMPLATE, timeout=120, metadata={"suite": "async", "i": str(i)})
    try:
        r = await sb.commands.run(f"echo hello {i}; echo e >&2")
        check(r.stdout == f"hello {i}\n" and r.stderr == "e\n", f"[{i}] run")
        try:
            await sb.commands.run("exit 3")
            check(False, "non-zero raises")
        except CommandExitException as e:
            check(e.exit_code == 3, f"[{i}] exit 3 raises")
        r = await sb.commands.run("echo $A; pwd", envs={"A": "a"}, cwd="/etc")
        check(r.stdout == "a\n/etc\n", f"[{i}] env and cwd")
        h = await sb.commands.run("sleep 300", background=True)
        check(any(p.pid == h.pid for p in await sb.commands.list()), f"[{i}] background listed")
        check(await sb.commands.kill(h.pid), f"[{i}] killed")
        await sb.files.write(f"/tmp/f{i}", f"data {i}")
        check(await sb.files.read(f"/tmp/f{i}") == f"data {i}", f"[{i}] write/read")
        await sb.files.write(f"/tmp/b{i}", b"\x00\x01" * 1000)
        check(bytes(await sb.files.read(f"/tmp/b{i}", format="bytes")) == b"\x00\x01" * 1000, f"[{i}] bytes")
        check(await sb.files.make_dir(f"/tmp/d{i}"), f"[{i}] make_dir")
        await sb.files.rename(f"/tmp/f{i}", f"/tmp/d{i}/g")
        check([e.name for e in await sb.files.list(f"/tmp/d{i}")] == ["g"], f"[{i}] rename + list")
        check((await sb.files.get_info(f"/tmp/d{i}/g")).size == len(f"data {i}"), f"[{i}] get_info")
        await sb.files.remove(f"/tmp/d{i}")
        check(not await sb.files.exists(f"/tmp/d{i}"), f"[{i}] remove + exists")
        try:
            await sb.files.read("/missing")
            check(False, "missing file raises")
        except FileNotFoundException:
            check(True, f"[{i}] missing file raises FileNotFoundException")
        await sb.set_timeout(300)
        info = await sb.get_info()
        check(info.metadata["i"] == str(i), f"[{i}] get_info metadata")
    finally:
        await sb.kill()
    return sb.sandbox_id


async def main():
    ids = await asyncio.gather(*(one(i) for i in range(4)))
    check(len(set(ids)) == 4, "four sandboxes at once")
    left = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"})).next_items()
    check(left == [], "all killed")


asyncio.run(main())
all_ok()
