"""The sandbox service's image (sandbox/Containerfile) under podman, run as docs/sandbox.md's recipe says (plus
--init: test_no_zombie_in_the_container).

What the server reports and enforces inside the container (namespaces, the token from the environment, the image's
HEALTHCHECK), its refusal to start without the capability, the multi-server client over two containers,
SandboxFusion's route (test_sandboxfusion.py's tests, run here against the container), the isolation and
clean-state probes from inside, no zombie process left by calls however they end, and a stop and a restart.

One container serves the module, with one kernel (--pool-size 1 --max-kernels 1: the clean-state probes' calls
then reach the same kernel, as in test_clean_state.py); a second one, started beside it, serves the multi-server
and the stop test. Skipped where podman is not installed (containers.py builds the image once per session).
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from stare_sandbox.app import ServerSettings
from stare_sandbox.client import SandboxClient
from stare_sandbox.isolation import UID_BASE, UID_RANGE_SIZE
from stare_sandbox.schemas import RunResult

from . import test_sandboxfusion
from .containers import Container, image, podman
from .test_clean_state import CHECK, PATCH, _leaks, _state
from .test_isolation import ATTEMPT, WRITE

pytestmark = pytest.mark.slow

FLAGS = ("--pool-size", "1", "--max-kernels", "1")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Container, Container]]:
    """Two containers of the image with one token, started together; stopped (SIGTERM) and removed after."""
    tag = image()
    first = Container(tag, *FLAGS)
    both = (first, Container(tag, *FLAGS, token=first.token))
    try:
        for container in both:
            container.start(wait=False)
        for container in both:
            container.wait_ready()
            print(f"containers: {container.name} ready {container.ready_s:.1f} s after its start", file=sys.stderr)
        yield both
    finally:
        for container in both:
            try:
                if container.created:
                    container.stop()
            finally:
                container.remove()


@pytest.fixture(scope="module")
def container(pair: tuple[Container, Container]) -> Container:
    return pair[0]


@pytest.fixture
def client(container: Container) -> Iterator[SandboxClient]:
    with SandboxClient(container.url, token=container.token) as c:
        yield c


def test_healthz_reports_namespaces_and_every_other_route_needs_the_token(container: Container):
    health = httpx.get(f"{container.url}/healthz").json()
    assert health["isolation"]["mode"] == "namespaces", health
    assert health["capacity"] == {"sessions": ServerSettings().max_sessions, "kernels": 1}
    assert health["token_accepted"] is False  # asked without one
    body = {"code": "print(6 * 7)"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.post(f"{container.url}/v1/execute", json=body, headers=headers).status_code == 401
        assert httpx.get(f"{container.url}/metrics", headers=headers).status_code == 401
    auth = {"Authorization": f"Bearer {container.token}"}  # the server has it from $SANDBOX_TOKEN only
    ran = httpx.post(f"{container.url}/v1/execute", json=body, headers=auth, timeout=60)
    assert (ran.status_code, ran.json()["stdout"]) == (200, "42\n")
    # the image's HEALTHCHECK (kept by `build --format docker`), run once by hand: podman here has no systemd to
    # schedule it (it logs that, and runs the container all the same)
    assert podman("healthcheck", "run", container.name, check=False).returncode == 0


def test_without_the_capability_require_isolation_refuses_to_start():
    """podman's defaults (no CAP_SYS_ADMIN, its seccomp profile) do not let the launcher's `unshare` make
    namespaces: the server must refuse to start rather than fall back to process isolation. The capability is the
    part that matters: with it podman's seccomp profile allows unshare too."""
    refused = Container(image(), privileges=())
    try:
        started = time.monotonic()
        refused.start(wait=False)
        status = refused.wait(timeout=60)
        took, said = time.monotonic() - started, refused.logs()
    finally:
        refused.remove()
    assert status != 0 and took < 30
    assert len(said.strip().splitlines()) == 1, said  # one line, though it quotes the probe's program
    assert said.startswith("sandbox: --require-isolation: isolation='namespaces' does not work here"), said
    assert "unshare failed: Operation not permitted" in said


def test_the_multi_server_client_spreads_over_two_containers(pair: tuple[Container, Container]):
    """Each container's kernels see its hostname (the container's id), which tells the servers apart."""
    hostname = "import socket\nprint(socket.gethostname())"
    with SandboxClient([c.url for c in pair], token=pair[0].token) as client:
        alone = [httpx.get(f"{c.url}/healthz").json()["capacity"] for c in pair]
        health = client.health()
        assert health["status"] == "ok" and [s["url"] for s in health["servers"]] == [c.url for c in pair]
        assert health["capacity"] == {key: alone[0][key] + alone[1][key] for key in ("sessions", "kernels")}
        sessions = [client.create_session() for _ in pair]
        assert sorted(sid.split("-")[0] for sid in sessions) == ["0", "1"]  # one on each server
        for sid in sessions:
            assert client.execute(f"{hostname}\nhome = socket.gethostname()", sid).status == "ok"
        kept = [client.execute("print(home, socket.gethostname())", sid).stdout.split() for sid in sessions]
        for sid in sessions:
            client.close_session(sid)
        assert all(home == now for home, now in kept) and len({home for home, _ in kept}) == 2
        spread = Counter(client.execute(hostname).stdout.strip() for _ in range(6))
        assert set(spread) == {home for home, _ in kept} and min(spread.values()) >= 2, spread


# SandboxFusion's route: every test of test_sandboxfusion.py that takes its `server` fixture runs here too, against
# this module's `server`: the container behind a proxy that adds the token.
for _name, _test in vars(test_sandboxfusion).items():
    if _name.startswith("test_") and "server" in inspect.signature(_test).parameters:
        globals()[_name] = _test


class TokenProxy:
    """A reverse proxy on loopback that adds `Authorization: Bearer <token>` to every request: what docs/sandbox.md
    has verl's users put in front of a server with a token (verl and SandboxFusion's own client send none)."""

    def __init__(self, target: str, token: str):
        upstream = httpx.Client(base_url=target, headers={"Authorization": f"Bearer {token}"}, timeout=300)
        dropped = {"content-length", "transfer-encoding", "connection", "content-encoding", "server", "date"}

        class Forward(BaseHTTPRequestHandler):
            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                sent = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "accept")}
                reply = upstream.request(self.command, self.path, content=body, headers=sent)
                self.send_response(reply.status_code)
                for key, value in reply.headers.items():
                    if key.lower() not in dropped:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            do_GET = do_POST = do_DELETE = forward

            def log_message(self, *args: object) -> None:
                pass

        self._upstream = upstream
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._upstream.close()


@pytest.fixture(scope="module")
def server(container: Container) -> Iterator[TokenProxy]:
    proxy = TokenProxy(container.url, container.token)
    try:
        yield proxy
    finally:
        proxy.close()


ISOLATION_PROBE = (
    ATTEMPT
    + "\n"
    + WRITE
    + """
import json
def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\\0", " ")
    except OSError:
        return ""
home = os.environ["HOME"]
targets = ["/tmp/probe", "/opt/sandbox/probe", "/root/probe", "/etc/probe", os.path.dirname(home) + "/probe"]
print(json.dumps({
    "connect": [attempt(("1.1.1.1", 53)), attempt(("127.0.0.1", 8765))],  # the internet, the server's own port
    "outside_scratch": [write(path) for path in targets],
    "in_scratch": write(home + "/probe"),
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
    "processes": [cmdline(pid) for pid in os.listdir("/proc") if pid.isdigit()],
    "environment": dict(os.environ),
}))
"""
)


def test_isolation_probes_from_inside_the_container(container: Container, client: SandboxClient):
    """test_isolation.py's namespace probes, run by the server in the container through POST /v1/execute."""
    result = client.execute(ISOLATION_PROBE)
    assert result.status == "ok", result
    found = json.loads(result.stdout)
    assert "connected" not in found["connect"], found["connect"]
    assert "written" not in found["outside_scratch"] and found["in_scratch"] == "written", found
    uid = found["ids"][0]
    uid_base = httpx.get(f"{container.url}/healthz").json()["isolation"]["uid_base"]
    assert UID_BASE <= uid_base <= uid < uid_base + UID_RANGE_SIZE
    assert found["ids"] == [uid, uid, uid, []]
    # its own PID namespace: none of the container's processes (the server's among them) is visible
    assert found["processes"] and not any("stare_sandbox serve" in line for line in found["processes"])
    environment = found["environment"]
    assert "SANDBOX_TOKEN" not in environment and not any(container.token in v for v in environment.values())


HOME = "import os\nprint(os.environ['HOME'])\n"
"""Printed first by each probe: the kernel's scratch dir, one per kernel, tells which kernel ran it."""


def on_one_kernel(run: Callable[[str], RunResult]) -> tuple[dict, dict]:
    """test_clean_state.py's CHECK, PATCH, CHECK run by `run`, again until the three ran on one kernel (a kernel
    retires after a random number of stateless runs, pool.reuse_limit); the states the two checks found."""
    for _ in range(5):
        before, patched, after = (run(HOME + code) for code in (CHECK, PATCH, CHECK))
        assert patched.stdout.endswith("patched\n") and after.status == "ok", (patched, after)
        if len({result.stdout.splitlines()[0] for result in (before, patched, after)}) == 1:
            return _state(before.stdout), _state(after.stdout)
    raise AssertionError("in five tries the three calls never ran on one kernel")


def test_clean_state_probes_from_inside_the_container(client: SandboxClient):
    before, after = on_one_kernel(client.execute)
    assert _leaks(before, after) == {}

    def in_a_new_session(code: str) -> RunResult:
        session = client.create_session()
        try:
            return client.execute(code, session)
        finally:
            client.close_session(session)

    before, after = on_one_kernel(in_a_new_session)
    assert _leaks(before, after) == {}


PROCESS_STATES = """
import os
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        stat, cmdline = open(f"/proc/{pid}/stat").read(), open(f"/proc/{pid}/cmdline").read()
    except OSError:
        continue
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    name, command = stat[stat.index("(") + 1 : stat.rindex(")")], " ".join(cmdline.replace("\\0", " ").split())
    print(pid, state, parent, name, command[:80])
"""
"""Each process of the container: pid, state, parent, name and the start of its command line (/proc: no ps here)."""

ENDINGS = [
    "import os\nos._exit(3)",  # the worker exits
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",  # the worker is killed
    "import subprocess\nsubprocess.Popen(['sleep', '600'])",  # a child left running, killed by the clean-up
    "import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n        time.sleep(0.5)\n    os._exit(0)",  # orphan
    "while True:\n    pass",  # interrupted at its timeout
    "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",  # stuck: the pool kills it
    "import os, signal\nos.kill(-1, signal.SIGKILL)",  # every process of the kernel's uid: the kernel dies
]


def test_no_zombie_in_the_container(container: Container, client: SandboxClient):
    """Calls that end their processes in each way a call can, then the container's process table (read from /proc:
    the minbase image has no ps). Its PID 1 is podman's init (Container runs with --init): without it the server
    is PID 1, reaps only its own children, and each kernel the pool kills (the stuck one here) leaves its
    namespace's init a zombie under it; this test then fails."""
    for code in ENDINGS:
        client.execute(code, timeout_s=2)
    assert client.execute("print('next')").stdout == "next\n"  # on a new kernel after the last ending
    deadline = time.monotonic() + 10
    while True:
        table = [line.split(" ", 4) for line in container.exec("python", "-c", PROCESS_STATES).stdout.splitlines()]
        zombies = [line for line in table if line[1] == "Z"]
        if not zombies or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert zombies == [], "\n".join(map(" ".join, table))
    assert any("stare_sandbox serve" in command for *_, command in table)  # the table is the server's


def test_sigterm_stops_the_server_and_it_starts_again_on_its_port(pair: tuple[Container, Container]):
    second = pair[1]
    started = time.monotonic()
    assert second.stop() == 0  # nothing open: the drain ends at once and the server exits 0
    assert time.monotonic() - started < 10 and "Traceback" not in second.logs()
    second.start()  # the same container again: its port, token and flags
    with SandboxClient(second.url, token=second.token) as client:
        assert client.execute("print(1 + 1)").stdout == "2\n"
