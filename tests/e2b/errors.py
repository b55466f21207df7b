"""The error paths raise the SDK's own exceptions: a bad key, an unknown sandbox, an
unknown template, a missing file, a sandbox killed under a client."""

import os

from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
)
from e2b.exceptions import FileNotFoundException, SandboxNotFoundException, SandboxNotRunningException
from finish import all_ok

TEMPLATE = os.environ["STRATA_TEMPLATE"]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def raises(exc, f, what):
    try:
        f()
    except exc as e:
        print("ok:", what, "->", type(e).__name__, str(e)[:100], flush=True)
        return e
    except Exception as e:
        raise AssertionError(f"{what}: raised {type(e).__name__}: {e}, not {exc.__name__}")
    raise AssertionError(f"{what}: did not raise")


raises(AuthenticationException, lambda: Sandbox.create(TEMPLATE, api_key="wrong-key"), "a bad key")
raises(AuthenticationException, lambda: Sandbox.list(api_key="wrong-key").next_items(), "a bad key lists nothing")
raises(SandboxNotFoundException, lambda: Sandbox.connect("inosuchsandbox000000"), "connect to an unknown sandbox")
raises(SandboxNotFoundException, lambda: Sandbox.get_info("inosuchsandbox000000"), "get_info of an unknown sandbox")
raises(SandboxNotFoundException, lambda: Sandbox.set_timeout("inosuchsandbox000000", 10), "set_timeout of an unknown sandbox")
check(Sandbox.kill("inosuchsandbox000000") is False, "kill of an unknown sandbox is False")
raises(SandboxException, lambda: Sandbox.create("no-such-template"), "an unknown template")

sb = Sandbox.create(TEMPLATE, timeout=60)
try:
    raises(FileNotFoundException, lambda: sb.files.read("/no/such/file"), "read a missing file")
    raises(FileNotFoundException, lambda: sb.files.get_info("/no/such/file"), "get_info of a missing file")
    raises(FileNotFoundException, lambda: sb.files.list("/no/such/dir"), "list a missing dir")
    raises(FileNotFoundException, lambda: sb.files.rename("/no/such", "/tmp/x"), "rename a missing file")
    raises(FileNotFoundException, lambda: sb.files.remove("/no/such"), "remove a missing file")
    raises(SandboxException, lambda: sb.files.read("/tmp"), "read a directory")
    # A wrong access token on envd.
    from packaging.version import Version
    from e2b.connection_config import ConnectionConfig

    bad = Sandbox(
        sandbox_id=sb.sandbox_id,
        sandbox_domain=None,
        envd_version=Version("0.5.7"),
        envd_access_token="wrong",
        connection_config=ConnectionConfig(
            extra_sandbox_headers={"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": "wrong"}
        ),
    )
    raises(AuthenticationException, lambda: bad.commands.run("true"), "a wrong access token (commands)")
    raises(AuthenticationException, lambda: bad.files.read("/etc/hostname"), "a wrong access token (files)")
finally:
    sb.kill()
raises(SandboxNotRunningException, lambda: sb.commands.run("true"), "a command in a killed sandbox")
raises(SandboxNotRunningException, lambda: sb.files.read("/etc/hostname"), "a file of a killed sandbox")
check(sb.is_running() is False, "is_running of a killed sandbox")
all_ok()
