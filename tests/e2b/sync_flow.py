"""The unmodified e2b SDK (sync) against a Strata node: create, commands, files, list,
timeout, kill. Run by tests/e2b.rs with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY set,
STRATA_TEMPLATE naming a template of the node and STRATA_BIN (with STRATA_HOME and
STRATA_RUN_DIR) reaching the node's socket. Exits non-zero on the first failure."""

import io
import os
import time
import urllib.error
import urllib.request

from e2b import Sandbox, CommandExitException
from e2b.sandbox.filesystem.filesystem import FileType
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def wait_for(probe, secs=15.0):
    """probe()'s first truthy value, polled for up to `secs` (a loaded CI machine is slow to
    show what a fixed sleep expected); its last value if none was."""
    end = time.monotonic() + secs
    while True:
        v = probe()
        if v or time.monotonic() > end:
            return v
        time.sleep(0.1)


sb = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "sync", "n": "1"}, envs={"GLOBAL": "g1"})
try:
    check(sb.sandbox_id and sb.is_running(), "created and running")

    # Commands: stdout, stderr, exit codes, env, cwd.
    r = sb.commands.run("echo out; echo err >&2")
    check(r.stdout == "out\n" and r.stderr == "err\n" and r.exit_code == 0, "stdout/stderr/exit 0")
    try:
        sb.commands.run("echo before; exit 7")
        check(False, "a non-zero exit raises")
    except CommandExitException as e:
        check(e.exit_code == 7 and e.stdout == "before\n", "exit 7 raises CommandExitException")
    r = sb.commands.run("echo $FOO-$GLOBAL", envs={"FOO": "bar"})
    check(r.stdout == "bar-g1\n", "per-command env and the sandbox's envVars")
    r = sb.commands.run("pwd", cwd="/tmp")
    check(r.stdout == "/tmp\n", "cwd")
    r = sb.commands.run("pwd")
    check(r.stdout == "/root\n", "default cwd is the user's home")
    seen = []
    r = sb.commands.run("for i in 1 2 3; do echo line$i; done", on_stdout=seen.append)
    check("".join(seen) == "line1\nline2\nline3\n", "on_stdout callbacks")
    big = sb.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
    check(len(big.stdout) == 3_000_000, "3 MB of output streamed whole")

    # A background command: listed, killed.
    h = sb.commands.run("sleep 300", background=True)
    procs = sb.commands.list()
    check(any(p.pid == h.pid and p.args[-1] == "sleep 300" for p in procs), "background command listed")
    check(sb.commands.kill(h.pid), "kill returns True")
    try:
        h.wait()
        check(False, "a killed command raises")
    except CommandExitException as e:
        check(e.exit_code != 0, "the killed command ended non-zero")
    check(all(p.pid != h.pid for p in sb.commands.list()), "killed command no longer listed")
    check(not sb.commands.kill(h.pid), "killing it again returns False")

    # A command another client of the node started (`strata sandbox exec`): listed, killed.
    import subprocess

    out = subprocess.run(
        [os.environ["STRATA_BIN"], "sandbox", "exec", "--detach", sb.sandbox_id, "--", "sleep", "200"],
        check=True,
        capture_output=True,
    )
    other = wait_for(lambda: [p for p in sb.commands.list() if p.cmd == "sleep" and p.args == ["200"]])
    check(len(other) == 1, f"a command started by `strata sandbox exec` is listed ({out.stdout!r})")
    check(sb.commands.kill(other[0].pid), "and killed")

    # Connect to a running command. A connect follows what the command writes after it
    # (as envd's does), so the command waits for a file made after the connect: a fixed
    # sleep lost the race on a loaded CI machine.
    h = sb.commands.run(
        "while [ ! -e /tmp/go-late ]; do sleep 0.02; done; echo late", background=True
    )
    h2 = sb.commands.connect(h.pid)
    sb.commands.run("touch /tmp/go-late")
    r = h2.wait()
    check(r.stdout == "late\n", f"connect to a running command gets its later output ({r.stdout!r})")

    # stdin: sent, then closed.
    h = sb.commands.run("cat", background=True, stdin=True)
    sb.commands.send_stdin(h.pid, "line one\n")
    sb.commands.send_stdin(h.pid, b"line two\n")
    sb.commands.close_stdin(h.pid)
    r = h.wait()
    check(r.stdout == "line one\nline two\n", "stdin sent and closed")
    h = sb.commands.run("wc -c", background=True, stdin=True)
    sb.commands.stream_input(h.pid, [b"abc", "def", b"\n"])
    sb.commands.close_stdin(h.pid)
    check(h.wait().stdout.strip() == "7", "stdin streamed")
    r = sb.commands.run("cat; echo done")
    check(r.stdout == "done\n", "stdin=False by default: cat reads EOF")

    # A PTY: input, output, resize, kill.
    from e2b import PtySize

    t = sb.pty.create(PtySize(rows=24, cols=80))
    sb.pty.send_stdin(t.pid, b"stty size; echo pty-$((6*7))\n")
    text = ""
    resized = False
    try:
        for _, _, pty in t:
            text += bytes(pty or b"").decode(errors="replace")
            if not resized and "pty-42" in text:
                resized = True
                sb.pty.resize(t.pid, PtySize(rows=30, cols=100))
                sb.pty.send_stdin(t.pid, b"stty size; exit\n")
    except CommandExitException:
        pass
    check("pty-42" in text and "24 80" in text and "30 100" in text, f"PTY output and resize: {text[-200:]!r}")
    t = sb.pty.create(PtySize(rows=24, cols=80))
    check(sb.pty.kill(t.pid), "PTY killed")

    # Watch a directory (polled watcher).
    sb.files.make_dir("/tmp/w")
    w = sb.files.watch_dir("/tmp/w", recursive=True)
    sb.files.write("/tmp/w/new.txt", "x")
    sb.files.make_dir("/tmp/w/sub")
    time.sleep(0.3)
    sb.files.write("/tmp/w/sub/deep.txt", "y")
    sb.files.remove("/tmp/w/new.txt")
    evs = []
    want = {("new.txt", "create"), ("new.txt", "remove"), ("sub/deep.txt", "create")}

    def more_events():
        evs.extend((e.name, e.type.value) for e in w.get_new_events())
        return want <= set(evs)

    wait_for(more_events)
    check(("new.txt", "create") in evs and ("new.txt", "remove") in evs, f"watch events: {evs}")
    check(("sub/deep.txt", "create") in evs, "recursive watch sees new subdirectories")
    w.stop()
    w = sb.files.watch_dir("/tmp/w", include_entry=True)
    sb.files.write("/tmp/w/with-entry.txt", "12345")
    with_entry = wait_for(
        lambda: [e for e in w.get_new_events() if e.name == "with-entry.txt" and e.entry]
    )
    check(with_entry and with_entry[0].entry.path == "/tmp/w/with-entry.txt", "watch events with entry info")
    w.stop()

    # File metadata (user.e2b.* xattrs).
    wi = sb.files.write("/root/meta.txt", "m", metadata={"owner": "rl-job-7", "step": "3"})
    check(wi.metadata == {"owner": "rl-job-7", "step": "3"}, f"write with metadata: {wi.metadata}")
    check(sb.files.get_info("/root/meta.txt").metadata == {"owner": "rl-job-7", "step": "3"}, "metadata read back")
    listed_meta = [e.metadata for e in sb.files.list("/root") if e.name == "meta.txt"]
    check(listed_meta == [{"owner": "rl-job-7", "step": "3"}], "metadata in list")

    # A port of the sandbox, by the Host name get_host() builds.
    server = (
        "perl -MIO::Socket::INET -e '$s=IO::Socket::INET->new(LocalAddr=>\"127.0.0.1\",LocalPort=>8000,"
        "Listen=>5,ReuseAddr=>1) or die $!; while($c=$s->accept){$r=\"\"; while(<$c>){$r.=$_; last if /^\\r?\\n$/}"
        " ($p)=$r=~/^GET (\\S+)/; $b=\"hello from $p\"; print $c \"HTTP/1.1 200 OK\\r\\nContent-Length: \""
        ".length($b).\"\\r\\nConnection: close\\r\\n\\r\\n$b\"; close $c}'"
    )
    srv = sb.commands.run(server, background=True)
    host = sb.get_host(8000)
    body = None
    for _ in range(50):
        req = urllib.request.Request(os.environ["E2B_SANDBOX_URL"] + "/some/path?q=1", headers={"Host": host})
        try:
            body = urllib.request.urlopen(req).read()
            break
        except urllib.error.HTTPError as e:
            if e.code != 502:
                raise
            time.sleep(0.1)
    check(body == b"hello from /some/path?q=1", f"port 8000 through {host}: {body!r}")
    sb.commands.kill(srv.pid)

    # Files.
    info = sb.files.write("/tmp/t/hello.txt", "hello")
    check(info.path == "/tmp/t/hello.txt", "write str")
    check(sb.files.read("/tmp/t/hello.txt") == "hello", "read text")
    sb.files.write("/tmp/t/bin", bytes(range(256)) * 10)
    check(bytes(sb.files.read("/tmp/t/bin", format="bytes")) == bytes(range(256)) * 10, "write/read bytes")
    sb.files.write("/tmp/t/stream", io.BytesIO(b"x" * 1_000_000))
    got = b"".join(sb.files.read("/tmp/t/stream", format="stream"))
    check(got == b"x" * 1_000_000, "write a stream, read a stream")
    sb.files.write("/tmp/t/gz", "zipped" * 1000, gzip=True)
    check(sb.files.read("/tmp/t/gz", gzip=True) == "zipped" * 1000, "gzip both ways")
    names = sorted(e.name for e in sb.files.list("/tmp/t"))
    check(names == ["bin", "gz", "hello.txt", "stream"], f"list: {names}")
    e = sb.files.get_info("/tmp/t/hello.txt")
    check(e.type == FileType.FILE and e.size == 5 and e.owner == "root", "get_info of a file")
    check(sb.files.make_dir("/tmp/t/d1/d2"), "make_dir")
    check(not sb.files.make_dir("/tmp/t/d1/d2"), "make_dir of an existing one is False")
    check(sb.files.get_info("/tmp/t/d1").type == FileType.DIR, "get_info of a dir")
    deep = [e.path for e in sb.files.list("/tmp/t", depth=2) if e.path.startswith("/tmp/t/d1")]
    check(deep == ["/tmp/t/d1", "/tmp/t/d1/d2"], f"list depth 2: {deep}")
    moved = sb.files.rename("/tmp/t/hello.txt", "/tmp/t/d1/moved.txt")
    check(moved.path == "/tmp/t/d1/moved.txt", "rename")
    check(not sb.files.exists("/tmp/t/hello.txt") and sb.files.exists("/tmp/t/d1/moved.txt"), "exists")
    check(sb.commands.run("cat /tmp/t/d1/moved.txt").stdout == "hello", "the sandbox sees the files")
    sb.files.remove("/tmp/t/d1")
    check(not sb.files.exists("/tmp/t/d1"), "remove a tree")
    sb.files.write("relative.txt", "home")
    check(sb.commands.run("cat /root/relative.txt").stdout == "home", "relative paths are under home")
    sb.files.write_files([{"path": "/tmp/m/a", "data": "A"}, {"path": "/tmp/m/b", "data": b"B"}])
    check(sb.files.read("/tmp/m/a") + sb.files.read("/tmp/m/b") == "AB", "write_files (multipart)")

    # Signed URLs, fetched without any header.
    url = sb.download_url("/tmp/m/a")
    check(urllib.request.urlopen(url).read() == b"A", "signed download URL")
    up = sb.upload_url("/tmp/m/up.txt")
    boundary = "strata-test-boundary"
    form = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"up.txt\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\nuploaded\r\n--{boundary}--\r\n"
    ).encode()
    req = urllib.request.Request(
        up, data=form, method="POST", headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    urllib.request.urlopen(req).read()
    check(sb.files.read("/tmp/m/up.txt") == "uploaded", "signed upload URL")
    bad = url.replace("signature=v1_", "signature=v1_x")
    try:
        urllib.request.urlopen(bad)
        check(False, "a bad signature is refused")
    except urllib.error.HTTPError as e:
        check(e.code == 401, "a bad signature is refused (401)")

    # The control plane.
    info = sb.get_info()
    check(info.sandbox_id == sb.sandbox_id and info.metadata == {"suite": "sync", "n": "1"}, "get_info")
    listed = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"suite": "sync"})).next_items()
    check([s.sandbox_id for s in listed] == [sb.sandbox_id], "list by metadata")
    listed = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"suite": "nope"})).next_items()
    check(listed == [], "list by metadata, no match")
    before = sb.get_info().end_at
    sb.set_timeout(600)
    after = sb.get_info().end_at
    check((after - before).total_seconds() > 400, "set_timeout moves the end")
    metrics = sb.get_metrics()
    check(len(metrics) == 1 and metrics[0].mem_used > 0, "metrics")
    again = Sandbox.connect(sb.sandbox_id)
    check(again.commands.run("echo back").stdout == "back\n", "connect to a running sandbox")

    # Pause, then connect: files and a running process intact.
    sb.files.write("/tmp/kept.txt", "kept")
    # It runs until told to stop (a file), however slow this machine is between the checks.
    h = sb.commands.run(
        "i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); echo tick $i; sleep 0.1; done; echo $i > /tmp/ticks",
        background=True,
    )
    time.sleep(0.3)
    check(sb.pause(), "pause")
    check(sb.get_info().state.value == "paused", "state paused")
    check(not sb.pause(), "pausing a paused sandbox is False (409)")
    paused = Sandbox.list(query=__import__("e2b").SandboxQuery(state=[__import__("e2b").SandboxState.PAUSED])).next_items()
    check(sb.sandbox_id in [s.sandbox_id for s in paused], "list by state paused")
    resumed = Sandbox.connect(sb.sandbox_id)
    check(sb.get_info().state.value == "running", "connect resumed it")
    check(resumed.files.read("/tmp/kept.txt") == "kept", "files intact after pause")
    check(any(p.pid == h.pid for p in resumed.commands.list()), "the process is still there")
    resumed.files.write("/tmp/stop", "")
    r = resumed.commands.connect(h.pid).wait()
    ticks = int(resumed.files.read("/tmp/ticks").strip() or 0)
    check(r.exit_code == 0 and ticks >= 2, f"the process ran on to its end ({ticks} ticks)")
finally:
    killed = sb.kill()
check(killed, "kill")
check(not Sandbox.kill(sb.sandbox_id), "kill of a removed sandbox is False")

# Paging: three sandboxes, two a page.
made = [Sandbox.create(TEMPLATE, timeout=60, metadata={"suite": "paging"}) for _ in range(3)]
try:
    p = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"suite": "paging"}), limit=2)
    first = p.next_items()
    check(len(first) == 2 and p.has_next, "first page of two, more to come")
    second = p.next_items()
    check(len(second) == 1 and not p.has_next, "last page")
    check(sorted(s.sandbox_id for s in first + second) == sorted(s.sandbox_id for s in made), "pages cover all")
finally:
    for s in made:
        s.kill()

# A sandbox ends at its timeout: removed, or paused when asked.
short = Sandbox.create(TEMPLATE, timeout=2)
napper = Sandbox.create(TEMPLATE, timeout=2, lifecycle={"on_timeout": "pause"})
napper.files.write("/root/nap.txt", "zzz")
time.sleep(2)
check(wait_for(lambda: not short.is_running()), "a sandbox is removed at its timeout")
check(
    wait_for(lambda: napper.get_info().state.value == "paused"),
    "an auto-pause sandbox is paused at its timeout",
)
woken = Sandbox.connect(napper.sandbox_id, timeout=30)
check(woken.files.read("/root/nap.txt") == "zzz", "and connect resumes it, files intact")
woken.kill()
all_ok()
