"""The sandbox service end to end: a real server process on loopback, real kernels, the real client."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stare_sandbox.app import ServerSettings, open_files_needed
from stare_sandbox.client import AsyncSandboxClient, SandboxClient, SandboxUnavailable, SessionNotFound
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.pool import PoolSettings

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m stare_sandbox serve` in a subprocess; stop() waits for it to exit."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.preexec_fn = preexec_fn  # run in the child before the server starts, e.g. to set an rlimit
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stare_sandbox", "serve", *self.args],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=self.preexec_fn,
        )
        if wait:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
                try:
                    if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            raise RuntimeError("server did not become healthy in 60 s")
        return self

    def stop(self, sig: int = signal.SIGINT) -> None:
        """SIGINT stops it at once (calls running are answered, sessions closed); SIGTERM drains it first
        (test_drain.py), up to its --drain-s while sessions are open."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def served_then_clean(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[Server]:
    """A module's server with its own scratch root; stopping it must leave no kernel (nor anything user code
    started) and no scratch directory."""
    root = tmp_path_factory.mktemp("scratch")
    config = root.parent / "sandbox.yaml"
    config.write_text(f"pool:\n  scratch_root: {root}\n")
    srv = Server("--config", str(config), "--pool-size", "2", *flags).start()
    try:
        yield srv
    finally:
        srv.stop()
    assert processes_mentioning(str(root)) == []
    assert [p.name for p in root.iterdir() if p.name.startswith("kernel-")] == []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served_then_clean(tmp_path_factory, "--default-timeout-s", "10", "--output-limit-chars", "2000")


@pytest.fixture
def client(server: Server) -> Iterator[SandboxClient]:
    with SandboxClient(server.url) as c:
        yield c


def test_health_reports_isolation(client: SandboxClient):
    health = client.health()
    assert health["status"] == "ok"
    assert {"mode", "network", "rlimits", "scrubbed_env", "scratch_dir"} <= set(health["isolation"])


def test_session_keeps_state_and_closes(client: SandboxClient):
    sid = client.create_session()
    assert client.execute("x = 41", sid).status == "ok"
    result = client.execute("print(x + 1)\nx * 2", sid)
    assert (result.status, result.stdout) == ("ok", "42\n82\n")
    client.close_session(sid)
    with pytest.raises(SessionNotFound):
        client.execute("print(x)", sid)


def test_stateless_runs_do_not_share_state(client: SandboxClient):
    assert client.execute("y = 5; open('f.txt', 'w').write('hi')").status == "ok"
    result = client.execute("print(y)")
    assert result.status == "error" and result.error.name == "NameError"
    gone = client.execute("import os; print(os.path.exists('f.txt'))")
    assert gone.stdout == "False\n"
    assert client.execute("print(np.arange(3).sum(), sp.Integer(2) ** 10)").stdout == "3 1024\n"


def test_user_errors_are_reported_with_traceback(client: SandboxClient):
    result = client.execute("def f():\n    return 1 / 0\nf()")
    assert result.status == "error"
    assert result.error.name == "ZeroDivisionError" and "division by zero" in result.error.message
    assert "f()" in result.error.traceback and "\x1b[" not in result.error.traceback
    assert client.execute("import sys; sys.exit(3)").status == "error"
    stdin = client.execute("input('name? ')")
    assert stdin.status == "error" and stdin.error.name == "EOFError"  # no stdin, as a process reading /dev/null


def test_stderr_and_output_cap(client: SandboxClient):
    result = client.execute("import sys; print('a' * 100000); print('end'); _ = sys.stderr.write('warn')")
    assert result.status == "ok" and result.truncated
    assert len(result.stdout) < 2200 and result.stdout.startswith("aaa") and result.stdout.endswith("end\n")
    assert "characters cut" in result.stdout and result.stderr == "warn"


def test_timeout_interrupts_and_keeps_session(client: SandboxClient):
    sid = client.create_session()
    client.execute("kept = 7", sid)
    result = client.execute("while True:\n    pass", sid, timeout_s=1)
    assert result.status == "timeout" and 900 < result.duration_ms < 5000
    assert client.execute("print(kept)", sid).stdout == "7\n"
    client.close_session(sid)


def test_stuck_kernel_is_replaced(client: SandboxClient):
    sid = client.create_session()
    client.execute("lost = 1", sid)
    code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
    result = client.execute(code, sid, timeout_s=1)
    assert result.status == "timeout" and "restarted" in result.error.message
    after = client.execute("print(lost)", sid)
    assert after.status == "error" and after.error.name == "NameError"  # fresh kernel
    client.close_session(sid)


def test_memory_limit(client: SandboxClient):
    result = client.execute("x = bytearray(20 * 2**30)")
    assert result.status == "memory"
    assert client.execute("print('still here')").status == "ok"


def test_user_started_processes_do_not_outlive_the_session(client: SandboxClient, server: Server):
    sid = client.create_session()
    started = client.execute("import subprocess\np = subprocess.Popen(['sleep', '1234'])\nprint(p.pid)", sid)
    assert started.status == "ok"
    assert processes_mentioning("sleep 1234")
    client.close_session(sid)
    deadline = time.monotonic() + 10
    while processes_mentioning("sleep 1234") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning("sleep 1234") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_stops_the_server_cleanly(tmp_path: Path, signum: signal.Signals):
    """SIGTERM, SIGINT and SIGHUP (made a SIGTERM) stop the server with its clean-up: no kernel process and no
    scratch directory are left. (SIGHUP used to end it at once, leaving its scratch directories.) SIGTERM drains
    first: the session left open is cut at the deadline (1 s here)."""
    root = tmp_path / "scratch"
    root.mkdir()
    config = tmp_path / "sandbox.yaml"
    config.write_text(f"pool:\n  scratch_root: {root}\n")

    def defaults() -> None:  # as a foreground job has them, whatever this test process inherited
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)

    srv = Server(
        "--config", str(config), "--pool-size", "2", "--isolation", "process", "--drain-s", "1", preexec_fn=defaults
    )
    srv.start()
    try:
        with SandboxClient(srv.url) as c:
            session = c.create_session()
            assert c.execute("print(1)", session).stdout == "1\n"
        assert processes_mentioning(str(root)) != []
        srv.proc.send_signal(signum)
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    # SIGINT: after its clean-up uvicorn raises it again, and KeyboardInterrupt is taken as the way out (exit 0);
    # SIGTERM: the drain ends the server itself (exit 0), having cut the session
    log = srv.proc.stderr.read()
    assert code == 0, f"exit status {code}: {log[-2000:]}"
    assert ("cutting 1 sessions still open" in log) == (signum != signal.SIGINT), log[-2000:]
    assert processes_mentioning(str(root)) == []
    assert [p.name for p in root.iterdir() if p.name.startswith("kernel-")] == []


def test_hostile_code_through_the_service(client: SandboxClient, server: Server):
    """Network, files outside the scratch dir, the server's process: all out of reach (namespace isolation)."""
    if client.health()["isolation"]["mode"] != "namespaces":
        pytest.skip("namespace isolation is not available on this machine")
    attempts = {
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {server.port}), timeout=2)",
        "read_shadow": "open('/etc/shadow').read()",
        "write_outside": "open('/tmp/escaped.txt', 'w').write('x')",
        "signal_server": f"import os, signal\nos.kill({server.proc.pid}, signal.SIGTERM)",
    }
    for name, code in attempts.items():
        result = client.execute(code)
        assert result.status == "error", (name, result)
    assert not Path("/tmp/escaped.txt").exists()
    assert client.health()["status"] == "ok"  # the server survived


def test_disk_filler_hits_the_file_size_cap(client: SandboxClient):
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (200 * 2**20))"
    result = client.execute(code)
    assert result.status == "error" and "File too large" in (result.error.message + result.error.traceback)


def test_segfault_is_a_kernel_death(client: SandboxClient):
    result = client.execute("import ctypes\nctypes.string_at(0)")
    assert result.status == "sandbox_error" and result.error.name == "KernelDied"
    assert client.execute("print('next')").stdout == "next\n"


def test_kernel_death_is_a_sandbox_error_and_recovers(client: SandboxClient):
    sid = client.create_session()
    client.execute("v = 1", sid)
    died = client.execute("import os; os._exit(1)", sid)
    assert died.status == "sandbox_error" and died.error.name == "KernelDied"
    after = client.execute("print('fresh')", sid)
    assert after.status == "ok" and after.stdout == "fresh\n"
    client.close_session(sid)


def test_a_session_whose_kernel_died_gets_the_real_result_and_goes_on_when_every_slot_is_taken():
    """max_kernels=1: the dead kernel holds the only slot, so a replacement can only come once it is freed. The
    call that killed it says so (not KernelsBusy), and the session's next call runs on a new kernel."""
    srv = Server("--pool-size", "1", "--max-kernels", "1", "--queue-wait-s", "5").start()
    try:
        with SandboxClient(srv.url, retries=10, backoff_s=0.5) as client:
            sid = client.create_session()
            died = client.execute("import os; os._exit(1)", sid)
            assert (died.status, died.error.name) == ("sandbox_error", "KernelDied"), died.error
            after = client.execute("print('fresh')", sid)
            assert (after.status, after.stdout) == ("ok", "fresh\n"), after.error
            client.close_session(sid)
            assert client.health()["sessions"] == 0
    finally:
        srv.stop()


def test_bad_requests_get_json_4xx(server: Server):
    url = f"{server.url}/v1/execute"
    for response in (
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(url, json={}),
        httpx.post(url, json={"code": "1", "extra": 1}),
        httpx.post(url, json={"code": "1", "timeout_s": -1}),
    ):
        assert response.status_code == 422 and "detail" in response.json()
    big = httpx.post(url, json={"code": "#" * 200_000})
    assert big.status_code == 413 and "limit" in big.json()["detail"]
    missing = httpx.post(f"{server.url}/v1/sessions/nope/execute", json={"code": "1"})
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]
    assert httpx.delete(f"{server.url}/v1/sessions/nope").status_code == 404


def test_openapi_describes_the_contract(server: Server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    execute = spec["paths"]["/v1/execute"]["post"]
    assert {"200", "413", "422", "429"} <= set(execute["responses"])
    assert "RunResult" in spec["components"]["schemas"] and "ErrorResponse" in spec["components"]["schemas"]


def test_metrics_endpoint(server: Server):
    text = httpx.get(f"{server.url}/metrics").text
    assert "sandbox_runs_total" in text and "sandbox_pool_ready" in text


def test_healthz_and_metrics_report_the_configured_capacity():
    """What a trainer checks its step against at start: the most sessions and kernels the server holds at once."""
    srv = Server("--pool-size", "0", "--max-sessions", "5", "--max-kernels", "7", "--isolation", "process").start()
    try:
        health = httpx.get(f"{srv.url}/healthz", timeout=10).json()
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.stop()
    assert health["capacity"] == {"sessions": 5, "kernels": 7}
    gauges = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("sandbox_capacity_")
    }
    assert gauges == {"sandbox_capacity_sessions": 5.0, "sandbox_capacity_kernels": 7.0}


def test_token_required_off_loopback_and_checked():
    refused = subprocess.run(
        [sys.executable, "-m", "stare_sandbox", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "SANDBOX_TOKEN"},
    )
    assert refused.returncode != 0 and "token" in refused.stderr
    srv = Server("--pool-size", "1", env={"SANDBOX_TOKEN": "s3cret"}).start()
    try:
        assert httpx.post(f"{srv.url}/v1/execute", json={"code": "1"}).status_code == 401
        with SandboxClient(srv.url, token="wrong", retries=0) as bad, pytest.raises(SandboxUnavailable, match="401"):
            bad.execute("1")
        for token, says in [("wrong", "refuses a wrong access token"), (None, "refuses no access token")]:
            with SandboxClient(srv.url, token=token) as bad, pytest.raises(SandboxUnavailable, match=says):
                bad.start()  # found before the first call, without retries
        with SandboxClient(srv.url, token="s3cret") as good:
            assert good.start() is good
            assert good.execute("print(2)").stdout == "2\n"
            leaked = good.execute("import os; print(os.environ.get('SANDBOX_TOKEN'))")
            assert leaked.stdout == "None\n"
    finally:
        srv.stop()


def test_require_isolation_refuses_without_it():
    out = subprocess.run(
        [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(free_port()), "--isolation", "process"]
        + ["--require-isolation"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--require-isolation" in out.stderr and "Traceback" not in out.stderr


def test_the_open_files_limit_is_raised_at_start_or_the_server_refuses_kernels_that_cannot_fit():
    """A kernel holds ~16 descriptors in the server, so a soft limit of 1024 fits some 60: the server raises it to
    the hard limit and /healthz shows it; a hard limit too low for max_kernels stops it with one line."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    needed = open_files_needed(ServerSettings())
    if hard < needed + 100:
        pytest.skip(f"the hard open files limit here ({hard}) is below what the default settings need ({needed})")

    def soft_limit_256() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    srv = Server("--pool-size", "1", preexec_fn=soft_limit_256).start()
    try:
        files = httpx.get(f"{srv.url}/healthz", timeout=10).json()["open_files"]
    finally:
        srv.stop()
    assert (files["limit"], files["needed"]) == (hard, needed)
    assert 0 < files["open"] < 256

    def hard_limit_256() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    argv = [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(free_port())]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=hard_limit_256)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"sandbox: the server may need {needed} open files") and "--max-kernels" in out.stderr
    assert "limit is 256" in out.stderr


def test_server_restart_with_clients_retrying():
    srv = Server("--pool-size", "1").start()
    try:
        with SandboxClient(srv.url, retries=20, backoff_s=0.25) as c:
            sid = c.create_session()
            assert c.execute("print(1)").stdout == "1\n"
            srv.stop()
            restart = threading.Timer(1.0, srv.start, kwargs={"wait": False})
            restart.start()
            assert c.execute("print(2)").stdout == "2\n"  # retried until the new server answered
            restart.join()
            with pytest.raises(SessionNotFound):  # sessions do not survive a restart, and say so
                c.execute("print(3)", sid)
    finally:
        srv.stop()


def test_a_session_call_while_its_only_server_restarts_is_retried_not_lost():
    """One URL: a session call that cannot connect was never sent, so the client backs off and tries again; the
    server restarted on the same port answers that it does not know the session (not an instant sandbox_error),
    and a new session works at once. Both clients."""
    srv = Server("--pool-size", "1").start()
    restarts: list[threading.Timer] = []

    def restart_soon() -> None:
        srv.stop()
        restarts.append(threading.Timer(1.0, srv.start, kwargs={"wait": False}))
        restarts[-1].start()

    try:
        with SandboxClient(srv.url, retries=20, backoff_s=0.25) as c:
            sid = c.create_session()
            restart_soon()
            with pytest.raises(SessionNotFound):
                c.execute("print(1)", sid)
            sid = c.create_session()
            assert c.execute("print(2)", sid).stdout == "2\n"

        async def go() -> None:
            async with AsyncSandboxClient(srv.url, retries=20, backoff_s=0.25) as c:
                sid = await c.create_session()
                restart_soon()
                with pytest.raises(SessionNotFound):
                    await c.execute("print(3)", sid)

        asyncio.run(go())
    finally:
        for restart in restarts:  # a failed call may end the test before its restart: stop that server too
            restart.join()
        srv.stop()


def test_idle_sessions_expire():
    srv = Server("--pool-size", "1", "--session-idle-s", "1").start()
    try:
        with SandboxClient(srv.url) as c:
            sid = c.create_session()
            assert c.execute("a = 1", sid).status == "ok"
            deadline = time.monotonic() + 10
            while c.health()["sessions"] and time.monotonic() < deadline:
                time.sleep(0.2)
            with pytest.raises(SessionNotFound):
                c.execute("print(a)", sid)
    finally:
        srv.stop()


def test_overload_gets_429_with_retry_after():
    srv = Server("--pool-size", "1", "--max-running", "1", "--max-waiting", "0").start()
    try:

        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                slow = http.post("/v1/execute", json={"code": "import time; time.sleep(2)"})
                fast = http.post("/v1/execute", json={"code": "1"})
                first = asyncio.ensure_future(slow)
                await asyncio.sleep(0.5)
                return [await fast, await first]

        refused, done = asyncio.run(go())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert done.status_code == 200
    finally:
        srv.stop()


def test_a_call_waits_for_a_slot_at_most_queue_wait_s_and_making_a_session_takes_none():
    """However long the calls ahead run, one waiting for a call slot gets 503 with Retry-After once queue_wait_s
    has passed (its code never ran, so clients retry it), rather than an answer after the client's HTTP timeout,
    which takes a session's call for lost. Making a session runs no code: it takes no slot, so running calls do not
    hold it up."""
    # pool size 3: a kernel is still ready once the session and the slow call hold one each (with forked workers
    # both count as coming back, and no successor starts for them)
    srv = Server("--pool-size", "3", "--max-kernels", "4", "--max-running", "1", "--queue-wait-s", "3").start()
    try:

        async def go() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:

                async def ready() -> int:
                    return (await http.get("/healthz")).json()["pool_ready"]

                session = (await http.post("/v1/sessions")).json()["session_id"]
                slow = asyncio.ensure_future(
                    http.post("/v1/execute", json={"code": "import time; time.sleep(12)", "timeout_s": 30})
                )
                deadline = time.monotonic() + 120  # only stops a hung test
                while (await http.get("/healthz")).json()["running"] == 0 or await ready() == 0:
                    assert time.monotonic() < deadline, "no slot taken, or no kernel ready for a new session"
                    await asyncio.sleep(0.05)  # the one slot taken, and a kernel ready for a new session
                started = time.monotonic()
                created = await http.post("/v1/sessions")
                assert created.status_code == 201 and time.monotonic() - started < 2
                started = time.monotonic()
                refused = await http.post(f"/v1/sessions/{session}/execute", json={"code": "print(1)"})
                waited = time.monotonic() - started
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
                assert "queue_wait_s=3" in refused.json()["detail"] and 2.5 < waited < 10
                assert (await http.get("/healthz")).json()["running"] == 1, "the slow call ended: this proves nothing"
                slow.cancel()

        asyncio.run(go())
    finally:
        srv.stop()


def test_client_retries_until_the_server_is_up():
    srv = Server("--pool-size", "1")
    started = []

    def start_later() -> None:
        time.sleep(1.5)
        srv.start(wait=False)
        started.append(True)

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        with SandboxClient(srv.url, retries=12, backoff_s=0.5) as c:
            assert c.execute("print('up')").stdout == "up\n"
        assert started
    finally:
        thread.join()
        srv.stop()


@pytest.mark.slow
def test_many_sessions_in_parallel(server: Server):
    async def one(client: AsyncSandboxClient, i: int) -> list[str]:
        sid = await client.create_session()
        outs = []
        for j in range(20):
            result = await client.execute(f"acc = {i} * 100 + {j}\nprint(acc)", sid)
            outs.append(result.stdout if result.status == "ok" else f"{result.status}: {result.error}")
        await client.close_session(sid)
        return outs

    async def go() -> list[list[str]]:
        async with AsyncSandboxClient(server.url, timeout_s=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(go())
    for i, outs in enumerate(results):
        assert outs == [f"{i * 100 + j}\n" for j in range(20)]


def test_a_timeout_above_the_maximum_is_capped_and_says_so(client: SandboxClient):
    asked = client.execute("1", timeout_s=500)
    assert (asked.status, asked.timeout_s, asked.timeout_capped) == ("ok", 120.0, True)  # the server's max_timeout_s
    default = client.execute("1")
    assert (default.timeout_s, default.timeout_capped) == (10.0, False)
    sid = client.create_session()
    assert client.execute("1", sid, timeout_s=2.5).timeout_s == 2.5
    client.close_session(sid)


def test_in_process_client_same_interface():
    async def go() -> None:
        async with InProcessClient(PoolSettings(pool_size=1, default_timeout_s=5, max_timeout_s=8)) as client:
            capped = await client.execute("1", timeout_s=9)
            assert (capped.timeout_s, capped.timeout_capped) == (8.0, True)
            sid = await client.create_session()
            await client.execute("z = 3", sid)
            assert (await client.execute("print(z * 2)", sid)).stdout == "6\n"
            assert (await client.execute("print(z)")).error.name == "NameError"
            await client.close_session(sid)
            with pytest.raises(SessionNotFound):
                await client.execute("1", sid)

    asyncio.run(go())


def test_in_process_burst_of_stateless_calls_queues_instead_of_failing():
    """More concurrent calls than kernels may exist: they wait for a kernel instead of failing."""

    async def go() -> list:
        settings = PoolSettings(pool_size=1, max_kernels=2, default_timeout_s=5)
        async with InProcessClient(settings, max_running=6) as client:
            return await asyncio.gather(*(client.execute(f"print({i} * 2)") for i in range(12)))

    results = asyncio.run(go())
    assert [r.status for r in results] == ["ok"] * 12
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(12)]
