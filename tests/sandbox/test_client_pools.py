"""The HTTP clients split each server's connections over small httpx pools (stare_sandbox.client.POOL_CONNECTIONS).

The server here is a real uvicorn server on loopback, a stand-in for the sandbox that counts the requests it is
serving at once and holds each for a moment, so what is checked is what reaches a server: never more
connections than max_connections, and all of them in use when the load asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

import stare_sandbox.client as client_module
from stare_sandbox.client import AsyncSandboxClient, SandboxClient, _Pools

HOLD_S = 0.3


class Standin:
    def __init__(self) -> None:
        self.serving = 0
        self.most = 0
        self.app = FastAPI()

        @self.app.get("/healthz")
        async def healthz() -> dict:
            return {"status": "ok"}

        @self.app.post("/v1/execute")
        async def execute(body: dict) -> dict:
            self.serving += 1
            self.most = max(self.most, self.serving)
            try:
                await asyncio.sleep(HOLD_S)
            finally:
                self.serving -= 1
            return {"status": "ok", "stdout": body["code"], "stderr": "", "duration_ms": HOLD_S * 1000}


@pytest.fixture
def standin() -> Iterator[tuple[Standin, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    standin = Standin()
    server = uvicorn.Server(uvicorn.Config(standin.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in server did not start"
        time.sleep(0.05)
    yield standin, url
    server.should_exit = True
    thread.join(10)


def test_pools_are_split_to_the_size_limit_and_a_request_takes_the_one_with_most_room(monkeypatch):
    monkeypatch.setattr(client_module, "POOL_CONNECTIONS", 2)
    made: list[httpx.Limits] = []
    pools = _Pools(lambda limits: made.append(limits) or len(made) - 1, 5)
    assert [limits.max_connections for limits in made] == [2, 2, 1]
    assert all(limits.max_keepalive_connections == limits.max_connections for limits in made)
    with contextlib.ExitStack() as held:
        taken = [held.enter_context(pools.take()) for _ in range(6)]
    assert taken == [0, 1, 0, 1, 2, 0]  # the five connections filled before any request queues; then the first
    with pools.take() as again:  # all given back
        assert again == 0
    with pytest.raises(ValueError, match="max_connections"):
        _Pools(lambda limits: None, 0)


@pytest.mark.parametrize("client", ["async", "sync"])
def test_a_server_gets_at_most_max_connections_and_all_of_them_under_load(standin, client, monkeypatch):
    monkeypatch.setattr(client_module, "POOL_CONNECTIONS", 4)  # 10 connections: pools of 4, 4 and 2
    server, url = standin
    calls = 30

    async def go_async() -> list[str]:
        async with AsyncSandboxClient(url, retries=0, max_connections=10) as c:
            assert len(c._pools[0].clients) == 3
            return [r.stdout for r in await asyncio.gather(*(c.execute(f"{i}") for i in range(calls)))]

    def go_sync() -> list[str]:
        with SandboxClient(url, retries=0, max_connections=10) as c, ThreadPoolExecutor(calls) as threads:
            assert len(c._pools[0].clients) == 3
            return [r.stdout for r in threads.map(lambda i: c.execute(f"{i}"), range(calls))]

    started = time.monotonic()
    printed = asyncio.run(go_async()) if client == "async" else go_sync()
    assert printed == [f"{i}" for i in range(calls)]
    assert server.most == 10, f"the server served {server.most} at once; the client allows 10"
    assert time.monotonic() - started >= (calls / 10) * HOLD_S  # 3 waves of 10, none beyond the limit
