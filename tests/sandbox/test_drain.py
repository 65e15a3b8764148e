"""Draining on SIGTERM and readiness: a real server process on loopback, and the client's bookkeeping of it.

The rolling restart of two servers under agent load is tests/test_rolling_restart.py.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stare_sandbox.client import SandboxClient
from stare_sandbox.schemas import DRAINING_HEADER
from stare_sandbox.servers import DOWN_AFTER_REFUSALS, Servers

from .test_service import Server

FLAGS = ("--isolation", "process", "--pool-size", "1", "--max-kernels", "3", "--max-sessions", "2")


def answer(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, headers=headers, json={"detail": "x"}, request=httpx.Request("POST", "http://s"))


DRAINING = {"Retry-After": "1", DRAINING_HEADER: "1"}


def test_a_draining_server_gets_no_new_work_but_is_not_down():
    servers = Servers(("http://a", "http://b"), down_backoff_s=0.05)
    a, b = servers.list
    for _ in range(DOWN_AFTER_REFUSALS + 1):  # refusals for draining never mark it down
        assert servers.settle(a, answer(503, DRAINING), None, "POST", "/v1/execute")[0] == "refused"
    assert (a.up, a.draining, a.refusals, servers.known_unreachable(a)) == (True, True, 0, False)
    assert {servers.pick(set(), by_sessions=False).index for _ in range(3)} == {b.index}
    assert servers.settle(a, answer(200), None, "POST", "/v1/sessions/x/execute")[0] == "ok"
    assert a.draining  # a session's call answered: still no new work for it
    assert servers.to_probe(all_down=False) == []
    time.sleep(0.06)
    assert servers.to_probe(all_down=False) == [a]  # probed while it drains, every down_backoff_s
    servers.probed(a, None, draining=True)
    assert a.draining and servers.pick({b.index}, by_sessions=False) is None
    servers.settle(b, answer(503, DRAINING), None, "POST", "/v1/sessions")
    assert servers.to_probe(all_down=True) == [a, b]  # no server takes new work: all are probed at once
    servers.probed(b, None, draining=True)
    servers.probed(a, None)  # ready again (restarted)
    assert not a.draining and servers.pick({b.index}, by_sessions=False) is a
    # without the header a 503 with Retry-After is an overload: counted towards down
    servers.settle(a, answer(503, {"Retry-After": "1"}), None, "POST", "/v1/execute")
    assert (a.draining, a.refusals) == (False, 1)
    servers.probed(b, "cannot reach http://b/healthz", unreachable=True)  # exited: down, no longer draining
    assert (b.up, b.draining, servers.known_unreachable(b)) == (False, False, True)


@pytest.fixture
def server() -> Server:
    srv = Server(*FLAGS, "--drain-s", "3").start()
    yield srv
    srv.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_sigterm_drains_new_work_refused_sessions_served_until_the_deadline(server: Server):
    url = server.url
    health = httpx.get(f"{url}/healthz").json()
    assert (health["status"], health["live"], health["ready"], health["draining"]) == ("ok", True, True, False)
    assert httpx.get(f"{url}/readyz").status_code == 200 and metric(url, "sandbox_ready") == 1
    busy, idle = (httpx.post(f"{url}/v1/sessions").json()["session_id"] for _ in range(2))
    assert httpx.post(f"{url}/v1/sessions/{idle}/execute", json={"code": "y = 2"}).json()["status"] == "ok"
    full = httpx.get(f"{url}/readyz").json()  # max_sessions 2: not ready, yet alive and not draining
    assert full == {"ready": False, "not_ready_because": ["the session limit (2) is reached"]}
    running: list[httpx.Response] = []
    call = threading.Thread(
        target=lambda: running.append(
            httpx.post(f"{url}/v1/sessions/{busy}/execute", json={"code": "import time; time.sleep(1.5); z = 3"})
        )
    )
    call.start()
    time.sleep(0.5)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)

    for method, path, body in (
        ("POST", "/v1/sessions", None),
        ("POST", "/v1/execute", {"code": "1"}),
        ("POST", "/run_code", {"code": "print(1)", "language": "python"}),
    ):
        refused = httpx.request(method, f"{url}{path}", json=body)
        assert (refused.status_code, refused.headers.get(DRAINING_HEADER)) == (503, "1"), (path, refused.text)
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
    health = httpx.get(f"{url}/healthz").json()
    assert (health["status"], health["live"], health["ready"]) == ("draining", True, False)
    assert "draining" in health["not_ready_because"] and 0 < health["drain_left_s"] <= 3
    assert httpx.get(f"{url}/readyz").status_code == 503
    assert (metric(url, "sandbox_draining"), metric(url, "sandbox_ready")) == (1, 0)
    assert metric(url, "sandbox_drain_refused_total") == 3 and metric(url, "sandbox_rejected_total") == 0

    call.join()  # the call running at the signal is answered, and its session goes on
    assert running[0].json()["status"] == "ok"
    assert httpx.post(f"{url}/v1/sessions/{busy}/execute", json={"code": "print(z)"}).json()["stdout"] == "3\n"
    assert httpx.delete(f"{url}/v1/sessions/{busy}").status_code == 204
    assert httpx.post(f"{url}/v1/sessions/{idle}/execute", json={"code": "print(y)"}).json()["stdout"] == "2\n"
    server.proc.wait(timeout=20)  # the idle session stays open: the server exits at the deadline, cutting it
    assert server.proc.returncode == 0 and time.monotonic() - signalled >= 3
    log = server.proc.stderr.read()
    assert re.search(rf"cutting 1 sessions still open: {idle}\n", log), log[-2000:]


def test_without_sessions_it_exits_at_once_and_a_second_sigterm_ends_a_drain():
    srv = Server(*FLAGS, "--drain-s", "60").start()
    try:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=20)  # nothing open: no reason to wait for the deadline
        assert srv.proc.returncode == 0
        srv.start()
        assert httpx.post(f"{srv.url}/v1/sessions").status_code == 201
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{srv.url}/healthz").json()["status"] == "draining"
        srv.proc.send_signal(signal.SIGTERM)  # an operator's second signal: exit now, as before draining
        srv.proc.wait(timeout=20)  # not the 60 s deadline
        assert "drained in" not in srv.proc.stderr.read()
    finally:
        srv.stop()


def test_the_client_moves_new_work_off_a_draining_server_and_back_once_it_restarted():
    a, b = Server(*FLAGS, "--drain-s", "30").start(), Server(*FLAGS, "--drain-s", "30").start()
    try:
        with SandboxClient([a.url, b.url], down_backoff_s=0.2) as client:
            on_a = client.create_session()
            assert on_a.startswith("0-")
            client.execute("v = 41", on_a)
            a.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # new sessions and stateless calls go to b; the session on a goes on there
            assert client.create_session().startswith("1-")
            assert client.execute("print(2)").stdout == "2\n"
            assert client.execute("print(v + 1)", on_a).stdout == "42\n"
            assert [s["draining"] for s in client.server_stats()] == [True, False]
            summary = client.health()
            assert (summary["status"], summary["ready"], summary["draining"]) == ("degraded", 1, 1)
            assert summary["capacity"]["sessions"] == 2  # b's alone: a takes no new session
            assert [s["status"] for s in summary["servers"]] == ["draining", "ok"]
            calls_a = client.server_stats()[0]["calls"]
            for _ in range(4):
                client.execute("print(1)")
            assert client.server_stats()[0]["calls"] == calls_a  # none sent to a after it said draining
            client.close_session(on_a)
            a.proc.wait(timeout=20)  # its last session closed: a exits before its deadline
            a.start()
            deadline = time.monotonic() + 20
            while client.server_stats()[0]["draining"] and time.monotonic() < deadline:
                client.execute("print(1)")  # a probe of a is made once its pause is over
                time.sleep(0.2)
            assert [(s["up"], s["draining"]) for s in client.server_stats()] == [(True, False)] * 2
            assert client.create_session().startswith("0-")  # back in use: it holds fewer of our sessions
    finally:
        a.stop()
        b.stop()
