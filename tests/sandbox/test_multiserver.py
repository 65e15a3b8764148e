"""One client, several sandbox servers: real `python -m stare_sandbox serve` processes on loopback, real kernels.

What each server did is read from the server itself (/metrics run counters, /healthz session counts),
not from the client's own bookkeeping. Servers are small (one warm kernel each): the machine has 2 cores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stare_sandbox.app import ServerSettings
from stare_sandbox.client import AsyncSandboxClient, SandboxClient, SandboxUnavailable, SessionNotFound, check_urls
from stare_sandbox.schemas import RunResult

from .test_service import Server, free_port, processes_mentioning

# Process isolation: these tests are about the client, and servers sharing a host must not share kernel uids
# (namespace kernels run as UID_BASE + slot; before each pool held its own uid range, two servers' kernels
# could end each other's processes).
SERVER_FLAGS = ("--pool-size", "1", "--max-kernels", "6", "--default-timeout-s", "20", "--isolation", "process")


def wait_healthy(srv: Server, timeout_s: float = 120) -> Server:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server exited: {srv.proc.stderr.read()}")
        try:
            if httpx.get(f"{srv.url}/healthz", timeout=1).status_code == 200:
                return srv
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{srv.url} did not become healthy in {timeout_s} s")


def runs(url: str, kind: str = "stateless") -> float:
    """Calls of this kind the server at `url` finished (any status), from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sandbox_runs_total" and sample.labels.get("kind") == kind
    )


def rejected(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sandbox_rejected_total"
    )


def printed(result: RunResult) -> str:
    """What a call printed; a failed call fails the test with the whole result (status, error)."""
    assert result.status == "ok", result
    return result.stdout


def health(url: str) -> dict:
    return httpx.get(f"{url}/healthz", timeout=10).json()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    root = tmp_path_factory.mktemp("scratch")  # kernels' dirs: a killed server cannot remove its own
    config = root.parent / "multiserver.yaml"
    config.write_text(f"pool:\n  scratch_root: {root}\n")
    started = [Server("--config", str(config), *SERVER_FLAGS) for _ in range(3)]
    try:
        for srv in started:
            srv.start(wait=False)  # in parallel: each takes seconds to warm its kernel
        yield [wait_healthy(srv) for srv in started]
    finally:
        for srv in started:
            srv.stop()
    assert processes_mentioning(str(root)) == []  # no kernel outlives its server, the killed one's included


def urls(servers: list[Server]) -> list[str]:
    return [srv.url for srv in servers]


def test_a_url_list_is_checked_when_the_client_is_made():
    assert check_urls("http://127.0.0.1:1/") == ("http://127.0.0.1:1",)
    with pytest.raises(ValueError, match=r"\[1\] 'http://a:1' is listed twice \(first at \[0\]\)"):
        SandboxClient(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match=r"URL \[1\]: URL 'a:2' must be http\(s\)://HOST\[:PORT\]"):
        AsyncSandboxClient(["http://a:1", "a:2"])
    with pytest.raises(ValueError, match="non-empty list"):
        SandboxClient([])
    with SandboxClient(["http://a:1", "http://b:1"]) as client, pytest.raises(SessionNotFound, match="index>-"):
        client.execute("1", "abc")  # not an id this client handed out: says so, sends nothing


def test_a_malformed_session_id_is_unknown_and_closing_it_does_nothing():
    dead = ["http://127.0.0.1:1", "http://127.0.0.1:2"]  # nothing is sent for such ids
    with SandboxClient(dead, retries=0) as client:
        for sid in ("abc", "\u00b2-abc", "7-abc"):  # "²" is a digit to str.isdigit, not to int()
            with pytest.raises(SessionNotFound, match="index>-"):
                client.execute("1", sid)
            client.close_session(sid)

    async def go() -> None:
        async with AsyncSandboxClient(dead, retries=0) as client:
            await client.close_session("\u00b2-abc")

    asyncio.run(go())


def test_sessions_stick_to_the_server_that_made_them(servers: list[Server]):
    with SandboxClient(urls(servers)) as client:
        sessions = [client.create_session() for _ in range(3)]
        # New sessions go to the server with the fewest of ours: one each, and each server holds only its own.
        assert sorted(s.split("-", 1)[0] for s in sessions) == ["0", "1", "2"]
        assert [health(url)["sessions"] for url in urls(servers)] == [1, 1, 1]
        for i, sid in enumerate(sessions):
            assert client.execute(f"x = {i} * 10", sid).status == "ok"
        for _ in range(2):
            for sid in sessions:
                assert client.execute("x += 1", sid).status == "ok"
        assert [printed(client.execute("print(x)", sid)) for sid in sessions] == ["2\n", "12\n", "22\n"]
        # The server-side id works on its own server only.
        index, server_id = sessions[1].split("-", 1)
        owner = urls(servers)[int(index)]
        for url in urls(servers):
            answer = httpx.post(f"{url}/v1/sessions/{server_id}/execute", json={"code": "print(x)"}, timeout=30)
            assert answer.status_code == (200 if url == owner else 404)
        for sid in sessions:
            client.close_session(sid)
        assert [health(url)["sessions"] for url in urls(servers)] == [0, 0, 0]


def test_the_summary_sums_the_capacity_of_the_servers_that_answered(servers: list[Server]):
    """Each server's /healthz capacity (the default max_sessions, 6 kernels here) is summed over those that answer;
    one that does not answer adds nothing and is listed as down."""
    sessions = ServerSettings().max_sessions
    dead = f"http://127.0.0.1:{free_port()}"
    with SandboxClient([*urls(servers[:2]), dead], retries=0) as client:
        summary = client.health()
    assert summary["status"] == "degraded"
    each = {"sessions": sessions, "kernels": 6}
    assert [entry.get("capacity") for entry in summary["servers"]] == [each, each, None]
    assert summary["capacity"] == {"sessions": 2 * sessions, "kernels": 12}


def test_stateless_calls_are_spread_over_the_servers(servers: list[Server]):
    before = [runs(url) for url in urls(servers)]
    with SandboxClient(urls(servers)) as client:
        outs = [printed(client.execute(f"print({i} ** 2)")) for i in range(12)]
    assert outs == [f"{i**2}\n" for i in range(12)]
    # One call at a time: every server is idle at each choice, so they take turns.
    assert [runs(url) - b for url, b in zip(urls(servers), before, strict=True)] == [4, 4, 4]

    before = [runs(url) for url in urls(servers)]
    with SandboxClient(urls(servers)) as client, ThreadPoolExecutor(6) as threads:  # one client shared by threads
        outs = list(threads.map(lambda i: printed(client.execute(f"print({i} + 1)")), range(18)))
        stats = client.server_stats()
    assert outs == [f"{i + 1}\n" for i in range(18)]
    assert sum(runs(url) - b for url, b in zip(urls(servers), before, strict=True)) == 18
    assert [s["in_flight"] for s in stats] == [0, 0, 0] and sum(s["calls"] for s in stats) == 18


def test_a_call_goes_to_a_server_without_calls_in_flight(servers: list[Server]):
    async def go() -> None:
        async with AsyncSandboxClient(urls(servers)) as client:
            slow = asyncio.create_task(client.execute("import time; time.sleep(60)", timeout_s=10))
            while not any(s["in_flight"] for s in client.server_stats()):
                await asyncio.sleep(0.01)
            busy = next(i for i, s in enumerate(client.server_stats()) if s["in_flight"])
            before = [runs(url) for url in urls(servers)]
            for i in range(4):
                assert printed(await client.execute(f"print({i})")) == f"{i}\n"
            after = [runs(url) for url in urls(servers)]
            assert client.server_stats()[busy]["in_flight"] == 1, "the slow call ended early: this proves nothing"
            assert after[busy] == before[busy]  # the busy server got none of the four
            assert sum(after) - sum(before) == 4
            assert (await slow).status == "timeout"

    asyncio.run(go())


def test_a_server_refusing_calls_is_skipped(servers: list[Server]):
    # `busy` runs one call at a time and queues none: while it runs a slow call, it answers 429 at once.
    busy = Server("--pool-size", "1", "--max-running", "1", "--max-waiting", "0", "--isolation", "process").start()
    try:

        async def go() -> None:
            async with httpx.AsyncClient(base_url=busy.url, timeout=60) as http:
                code = {"code": "import time; time.sleep(60)", "timeout_s": 8}  # the stop waits for it
                slow = asyncio.ensure_future(http.post("/v1/execute", json=code))
                while health(busy.url)["running"] == 0:
                    await asyncio.sleep(0.05)
                other = servers[0].url
                before = runs(other)
                with SandboxClient([busy.url, other], down_backoff_s=600) as client:
                    outs = [printed(client.execute(f"print({i})")) for i in range(6)]
                assert health(busy.url)["running"] == 1, "the slow call ended early: this check proves nothing"
                assert outs == [f"{i}\n" for i in range(6)]  # every refused call went on to the other server
                assert runs(other) - before == 6
                # Refused DOWN_AFTER_REFUSALS (3) times in a row, the busy server is left alone after that.
                assert rejected(busy.url) == 3
                slow.cancel()

        asyncio.run(go())
    finally:
        busy.stop()


def test_all_servers_down_names_every_server():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with SandboxClient(dead, retries=1, backoff_s=0.05) as client:
        for call in (client.start, lambda: client.execute("1"), client.create_session):
            with pytest.raises(SandboxUnavailable) as caught:
                call()
            message = str(caught.value)
            assert "none of the 2 sandbox servers" in message
            for url in dead:
                assert f"cannot reach {url}/" in message and "Connection refused" in message

    async def go() -> None:
        async with AsyncSandboxClient(dead, retries=0) as client:
            with pytest.raises(SandboxUnavailable, match=f"cannot reach {dead[0]}/.*cannot reach {dead[1]}/"):
                await client.execute("1")

    asyncio.run(go())


def test_a_server_killed_mid_call(servers: list[Server]):
    """Its session gets sandbox_error naming it, a stateless call that was running there is not run again
    elsewhere, later calls go to the others, and once it is back on its port it takes calls again."""
    all_urls = urls(servers)

    async def go() -> None:
        async with AsyncSandboxClient(all_urls, down_backoff_s=0.5) as client:
            sessions = [await client.create_session() for _ in range(3)]
            for i, sid in enumerate(sessions):
                assert (await client.execute(f"x = {i}", sid)).status == "ok"
            slow_stateless = asyncio.create_task(client.execute("import time; time.sleep(60)", timeout_s=30))
            while not any(s["in_flight"] for s in client.server_stats()):
                await asyncio.sleep(0.01)
            victim = next(i for i, s in enumerate(client.server_stats()) if s["in_flight"])
            session = next(sid for sid in sessions if sid.startswith(f"{victim}-"))
            slow_session = asyncio.create_task(client.execute("import time; time.sleep(60)", session, timeout_s=30))
            while health(all_urls[victim])["running"] < 2:  # both calls are running on the victim's kernels
                await asyncio.sleep(0.05)
            others = [i for i in range(3) if i != victim]
            before = {i: runs(all_urls[i]) for i in others}
            servers[victim].proc.kill()  # a crash: no graceful end of the running calls
            servers[victim].proc.wait()

            lost = await slow_session
            assert lost.status == "sandbox_error" and all_urls[victim] in lost.error.message
            with pytest.raises(SandboxUnavailable, match="failed after sending"):
                await slow_stateless  # it may have run: not run again on another server
            assert {i: runs(all_urls[i]) for i in others} == before

            again = await client.execute("print(x)", session)
            assert again.status == "sandbox_error" and all_urls[victim] in again.error.message
            for i in others:  # the other sessions keep their state
                sid = next(s for s in sessions if s.startswith(f"{i}-"))
                assert printed(await client.execute("print(x)", sid)) == f"{i}\n"
            calls_to_victim = client.server_stats()[victim]["calls"]
            outs = [printed(await client.execute(f"print({i})")) for i in range(6)]
            assert outs == [f"{i}\n" for i in range(6)]
            assert sum(runs(all_urls[i]) - before[i] for i in others) == 6
            assert client.server_stats()[victim]["calls"] == calls_to_victim  # skipped while down

            wait_healthy(servers[victim].start(wait=False))  # back on the same port, a new process
            deadline = time.monotonic() + 60
            while runs(all_urls[victim]) == 0:
                assert time.monotonic() < deadline, f"{all_urls[victim]} is up again but gets no calls"
                assert printed(await client.execute("print(1)")) == "1\n"
                await asyncio.sleep(0.1)
            with pytest.raises(SessionNotFound):  # the new process does not know the old session, and says so
                await client.execute("print(x)", session)
            for sid in sessions:
                await client.close_session(sid)

    asyncio.run(go())


def test_a_session_call_is_not_lost_for_a_connect_timeout_another_request_saw(servers: list[Server]):
    """An event loop stalled past the connect timeout (seconds, on a loaded machine) turns a connection to a live
    server into ConnectTimeout, and the server is then taken for unreachable until its next probe. A session call
    there makes its own try and is served, and closing the session reaches the server, rather than the call coming
    back "lost with its server" at once and the session staying open there."""
    timed_out = httpx.ConnectTimeout("timed out")  # what another request of this client saw

    async def go() -> int:
        async with AsyncSandboxClient(urls(servers), down_backoff_s=600) as client:
            session = await client.create_session()
            assert (await client.execute("x = 41", session)).status == "ok"
            server = client._servers.list[int(session.split("-")[0])]
            client._servers.settle(server, None, timed_out, "POST", "/v1/execute")
            assert not client.server_stats()[server.index]["up"]
            assert printed(await client.execute("print(x + 1)", session)) == "42\n"
            assert client.server_stats()[server.index]["up"]  # it answered
            client._servers.settle(server, None, timed_out, "POST", "/v1/execute")
            await client.close_session(session)
            return server.index

    index = asyncio.run(go())
    assert health(urls(servers)[index])["sessions"] == 0
    with SandboxClient(urls(servers), down_backoff_s=600) as client:  # the sync client alike
        session = client.create_session()
        server = client._servers.list[int(session.split("-")[0])]
        client._servers.settle(server, None, timed_out, "POST", "/v1/execute")
        assert printed(client.execute("print(6 * 7)", session)) == "42\n"
        client._servers.settle(server, None, timed_out, "POST", "/v1/execute")
        client.close_session(session)
    assert health(server.url)["sessions"] == 0


def test_each_server_has_its_own_connections(servers: list[Server]):
    """A client's connection limit is per server: a call to one server does not wait for (or take) a connection
    of another's. (One pool for all servers, when full, closed an idle connection to one server to open one to
    another, which httpcore can do to a connection it has just handed to a request: it failed after sending.)"""

    async def go() -> tuple[str, bool]:
        async with AsyncSandboxClient(urls(servers)[:2], max_connections=1) as client:
            session = await client.create_session()
            try:
                slow = asyncio.create_task(client.execute("import time; time.sleep(6); print('slow')", session))
                await asyncio.sleep(1)  # the slow call holds its server's only connection
                quick = await asyncio.wait_for(client.execute("print('quick')"), 5)  # stateless: the idle server
                return printed(quick), slow.done()
            finally:
                assert printed(await slow) == "slow\n"
                await client.close_session(session)

    assert asyncio.run(go()) == ("quick\n", False)
