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


def late_end_stream(h, size):
    """Process/Start of `head -c size` over a raw HTTP/1.1 socket with a small receive
    buffer: the body's terminator is sent 0.3 s after its one message, the answer read slowly
    after a pause. The stdout bytes the stream carried (an error if it ends without its end
    envelope)."""
    import base64
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(URL)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.connect((u.hostname, u.port))
    s.settimeout(30)
    msg = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", f"head -c {size} /dev/zero | tr '\\0' a"]}})
    head = f"POST /process.Process/Start HTTP/1.1\r\nHost: {u.netloc}\r\n"
    for k, v in {**h, "Content-Type": "application/connect+json", "Transfer-Encoding": "chunked"}.items():
        head += f"{k}: {v}\r\n"
    s.sendall(head.encode() + b"\r\n" + b"%x\r\n" % len(msg) + msg + b"\r\n")
    time.sleep(0.3)
    s.sendall(b"0\r\n\r\n")
    time.sleep(1.0)
    raw = b""
    while True:
        try:
            b = s.recv(8192)
        except ConnectionResetError as e:
            raise AssertionError(f"the stream was reset after {len(raw)} bytes: {e}")
        if not b:
            break
        raw += b
        if raw.endswith(b"\r\n0\r\n\r\n"):
            break
    s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise AssertionError(f"answer: {head[:200]!r}")
    chunks, rest = [], body
    while True:
        line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            raise AssertionError(f"the chunked body is cut short after {sum(map(len, chunks))} bytes")
        n = int(line, 16)
        if n == 0:
            break
        chunks.append(rest[:n])
        rest = rest[n + 2 :]
    got, ended = 0, False
    for flags, m in frames(chunks):
        if flags & 2:
            if m.get("error"):
                raise AssertionError(f"the stream ended with {m}")
            ended = True
        elif "data" in m.get("event", {}):
            got += len(base64.b64decode(m["event"]["data"].get("stdout", "")))
    if not ended:
        raise AssertionError(f"no end envelope after {got} bytes")
    return got


sb = Sandbox.create(TEMPLATE, timeout=60)
try:
    h = {"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token}
    sb.files.make_dir("/tmp/ws")
    got = []
    started = threading.Event()

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
                started.set()
                if "filesystem" in msg:
                    return

    t = threading.Thread(target=watch)
    t.start()
    # The start event comes once the watch is in place (under load that can take a while).
    check(started.wait(10), "WatchDir started")
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

    # A server stream whose request body ends late (its chunked terminator after the server
    # has read the one message, as when a proxy forwards the body in two writes) and whose
    # client reads slowly: the whole output and the end envelope still arrive. (A server that
    # drops the unread rest of the body closes the socket with input unread: the kernel
    # answers with a reset and throws away the response's unsent tail.)
    check(late_end_stream(h, 3_000_000) == 3_000_000, "a late request end and a slow reader lose nothing")

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
