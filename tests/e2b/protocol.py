"""The wire itself, below the SDK: a WatchDir server stream (what the JS SDK uses), a Connect
unary error's shape, a stream's end envelope, and a request over HTTP/2 (h2c)."""

import json
import os
import struct
import threading
import time

import httpx

from e2b import Sandbox
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]
URL = os.environ["E2B_SANDBOX_URL"]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def envelope(msg, flags=0):
    b = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(b)) + b


def frames(chunks):
    buf = b""
    for c in chunks:
        buf += c
        while len(buf) >= 5:
            flags, n = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + n:
                break
            yield flags, json.loads(buf[5 : 5 + n])
            buf = buf[5 + n :]


sb = Sandbox.create(TEMPLATE, timeout=60)
try:
    h = {"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token}
    sb.files.make_dir("/tmp/ws")
    got = []

    def watch():
        with httpx.stream(
            "POST",
            URL + "/filesystem.Filesystem/WatchDir",
            headers={**h, "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
            content=envelope({"path": "/tmp/ws"}),
            timeout=10,
        ) as r:
            for flags, msg in frames(r.iter_raw()):
                got.append((flags, msg))
                if "filesystem" in msg:
                    return

    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.5)
    sb.files.write("/tmp/ws/f", "x")
    t.join(10)
    check(got and got[0] == (0, {"start": {}}), f"WatchDir starts with a start event: {got[:1]}")
    check(
        any(m.get("filesystem", {}).get("name") == "f" for _, m in got),
        f"WatchDir streams the event: {got}",
    )

    r = httpx.post(
        URL + "/filesystem.Filesystem/Stat",
        headers={**h, "Content-Type": "application/json"},
        json={"path": "/nope"},
    )
    check(r.status_code == 404 and r.json()["code"] == "not_found", f"unary error: {r.status_code} {r.text}")

    r = httpx.post(
        URL + "/process.Process/Connect",
        headers={**h, "Content-Type": "application/connect+json"},
        content=envelope({"process": {"pid": 999999}}),
    )
    fs = list(frames([r.content]))
    check(
        r.status_code == 200 and fs[-1][0] == 2 and fs[-1][1]["error"]["code"] == "not_found",
        f"a stream's error is its end envelope: {fs}",
    )

    with httpx.Client(http1=False, http2=True) as c:
        r = c.post(
            URL + "/process.Process/List",
            headers={**h, "Content-Type": "application/json"},
            json={},
        )
        check(r.http_version == "HTTP/2" and r.status_code == 200, f"h2c: {r.http_version} {r.status_code}")
finally:
    sb.kill()
all_ok()
