"""The HTTP clients of the sandbox service, sync and async; the in-process client (inprocess.py) has their interface.

Retries: a call is retried with exponential backoff only when it certainly did not run -- the server
answered 429/503 (overloaded, no kernel), or the connection could not be made (also for a call in a
session: nothing was sent). A user-code failure is a normal RunResult and is never retried; neither is a call
whose connection broke after it was sent (it may have run, and a stateful session must not run code
twice). Such failures raise `SandboxUnavailable`, or, for a call in a session, come back as a RunResult
with status `sandbox_error`; callers treat both as an infrastructure failure, not a wrong answer.

Several servers: the HTTP clients take one URL or a list of them (same token for all).
- A session lives on the server that created it. With more than one server, the id handed out is
  `<server index>-<server's id>` (the index into the URL list), so a session id carries its server and
  the client keeps no table of ids; two clients built from the same list understand each other's ids.
  With one URL the id is the server's own, as before.
- A stateless call or a new session goes to the server with the fewest calls in flight from this client
  (new sessions: fewest open sessions from this client first), ties taken in turn.
- A server that cannot be connected to, answers 5xx (except 503 with Retry-After: busy), breaks a call
  after it was sent, or refuses DOWN_AFTER_REFUSALS calls in a row (429/503) is marked down: no new work
  goes there until a GET /healthz succeeds. That probe is made by the first call after a pause that
  starts at `down_backoff_s` and doubles while the server stays down (up to MAX_DOWN_S); when no server
  is up, every call probes them all, paced by its own retry backoff.
- A server that drains (shutting down after SIGTERM: it answers new work with 503 and the draining header, and
  /healthz with `status: draining`) gets no new work until a probe finds it ready again (restarted), but the calls
  of its open sessions go on there as usual. A rolling restart of the servers one at a time therefore loses no
  session that ends within the server's drain deadline (servers.py).
- A stateless call or session creation refused, or not connected, by one server (nothing ran) goes on
  at once to another server that is up; when none is left it backs off and tries again, `retries` times.
- A session call whose server cannot be connected to is retried there with backoff, `retries` times
  (nothing was sent). If it still cannot, or the call broke after it was sent, it gets a RunResult with
  status `sandbox_error` naming the server: its variables are gone, and the client never replays it
  elsewhere (the caller may start a new session). With several servers, a session call on a server known to
  be unreachable (until it answers a probe again) gets one try instead: a dead server fails it at once, and
  one only taken for dead still serves it. That happens: an event loop stalled past the connect timeout
  (seconds, under heavy load) turns a connection to a live server into ConnectTimeout. A call is never
  reported lost for what another request saw. A session on a server that restarted gets SessionNotFound
  (404), as with one server.
The sync client may be shared between threads (the bookkeeping is under a lock; httpx.Client is
thread-safe).
The two clients share everything but the transport: each call is a flow of `_Common` (a generator) that yields
the requests, probes and pauses it needs, and the client makes them, directly or awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Generic, TypeVar

import httpx

from stare_sandbox.schemas import ErrorInfo, RunResult
from stare_sandbox.servers import Server, Servers, detail

T = TypeVar("T")
H = TypeVar("H", httpx.Client, httpx.AsyncClient)
Steps = Generator[tuple, Any, T]
"""A call flow of `_Common`: it yields (transport method, *args) and is sent what that call returns."""
log = logging.getLogger("sandbox.client")
KEEPALIVE_S = 10.0
"""Idle connections are dropped after this, well before the server closes them (its keep-alive is 60 s): a
request on a connection the server closes at that moment fails after sending and cannot be retried safely.
(Both httpx and uvicorn default to 5 s, so under load such races happened.)"""
POOL_CONNECTIONS = 16
"""Most connections in one httpx pool: a server's connections are split over pools of this size, because
httpcore's cost per call grows with the square of a pool's size (measured in docs/sandbox.md)."""
PROBE_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


class SandboxUnavailable(RuntimeError):
    """The service could not be reached or kept refusing; the code did not run (or its fate is unknown)."""


class SessionNotFound(KeyError):
    """The session id is unknown: closed, expired, or from a restarted server."""


class _ServerLost(SandboxUnavailable):
    """A sticky call's server failed; execute() turns this into a sandbox_error RunResult."""


def _delay(attempt: int, backoff_s: float, response: httpx.Response | None) -> float:
    retry_after = response.headers.get("retry-after") if response is not None else None
    base = backoff_s * (2**attempt)
    if retry_after:
        try:
            return max(base, float(retry_after))
        except ValueError:
            pass
    return min(base, 10.0)


def _check(response: httpx.Response, url: str) -> httpx.Response:
    if response.status_code == 404 and "/sessions/" in url:
        raise SessionNotFound(detail(response) or url)
    if response.status_code >= 400:
        raise SandboxUnavailable(f"{response.request.method} {url}: HTTP {response.status_code}: {detail(response)}")
    return response


def check_url(url: str) -> str:
    """`url` without a trailing slash, or ValueError saying what is wrong with it (scheme, host)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = "http://" + url.strip().split("://")[-1] if url.strip() else "http://127.0.0.1:8765"
        raise ValueError(f"URL {url!r} must be http(s)://HOST[:PORT], e.g. {example!r}")
    return url.strip().rstrip("/")


def check_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """One URL or a non-empty list of distinct ones, each checked by `check_url`; ValueError names the bad one."""
    if isinstance(urls, str):
        return (check_url(urls),)
    if not isinstance(urls, Sequence) or not urls:
        raise ValueError(f"sandbox server URLs must be one URL or a non-empty list of them; got {urls!r}")
    checked: list[str] = []
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise ValueError(f"sandbox server URL [{i}] must be a string; got {url!r}")
        try:
            url = check_url(url)
        except ValueError as exc:
            raise ValueError(f"sandbox server URL [{i}]: {exc}") from None
        if url in checked:
            raise ValueError(f"sandbox server URL [{i}] {url!r} is listed twice (first at [{checked.index(url)}])")
        checked.append(url)
    return tuple(checked)


class _Pools(Generic[H]):
    """One server's connections: `ceil(max_connections / POOL_CONNECTIONS)` httpx clients, each of at most
    POOL_CONNECTIONS connections, none closed before keep-alive expiry (max_keepalive_connections =
    max_connections, see SandboxClient). A request takes the client with the most connections left (its size less
    the requests it has in flight, which may be negative: queued), the first of those tied."""

    def __init__(self, make: Callable[[httpx.Limits], H], max_connections: int):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1; got {max_connections}")
        full, rest = divmod(max_connections, POOL_CONNECTIONS)
        sizes = [POOL_CONNECTIONS] * full + ([rest] if rest else [])
        self.clients = [
            make(httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=KEEPALIVE_S))
            for n in sizes
        ]
        self._free = list(sizes)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self) -> Iterator[H]:
        with self._lock:
            i = max(range(len(self.clients)), key=self._free.__getitem__)
            self._free[i] -= 1
        try:
            yield self.clients[i]
        finally:
            with self._lock:
                self._free[i] += 1


class _Common:
    """What both HTTP clients share: settings, the server bookkeeping, session ids, and every call's flow.

    A flow (`Steps`) never does I/O: it yields `(self._send, ...)`, `(self._probe, servers)` or
    `(self._sleep, seconds)`, and the client's `_drive` makes that call of its transport and sends back the result
    (or throws in its exception), so the logic exists once for the blocking and the asyncio transport.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        token: str | None,
        retries: int,
        backoff_s: float,
        timeout_s: float,
        down_backoff_s: float,
    ):
        self.urls = check_urls(base_url)
        self.base_url = self.urls[0]
        if retries < 0 or backoff_s < 0 or timeout_s <= 0 or down_backoff_s <= 0:
            raise ValueError(
                f"retries and backoff_s must be >= 0, timeout_s and down_backoff_s > 0; got retries={retries}, "
                f"backoff_s={backoff_s}, timeout_s={timeout_s}, down_backoff_s={down_backoff_s}"
            )
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._servers = Servers(self.urls, down_backoff_s)

    def _server_pools(self, http_class: type[H], max_connections: int) -> list[_Pools[H]]:
        """Each server's connection pools (_Pools), in URL order."""

        def pools(url: str) -> _Pools[H]:
            return _Pools(
                lambda limits: http_class(base_url=url, headers=self.headers, limits=limits), max_connections
            )

        return [pools(url) for url in self.urls]

    def server_stats(self) -> list[dict[str, Any]]:
        """Per server, in URL order: url, up, calls sent by this client, in flight, open sessions, last error."""
        return self._servers.stats()

    def _session_id(self, server: Server, server_id: str) -> str:
        return server_id if len(self.urls) == 1 else f"{server.index}-{server_id}"

    def _session_of(self, session_id: str) -> tuple[Server, str]:
        """The server holding `session_id` and the id that server knows it by."""
        if len(self.urls) == 1:
            return self._servers.list[0], session_id
        index, sep, server_id = session_id.partition("-")
        if not (sep and index.isascii() and index.isdigit() and int(index) < len(self.urls) and server_id):
            raise SessionNotFound(
                f"session id {session_id!r} was not made by this client: with {len(self.urls)} servers an id "
                f"reads '<server index>-<id>', the index below {len(self.urls)}"
            )
        return self._servers.list[int(index)], server_id

    def _checked(self, health: dict[str, Any]) -> Any:
        servers = health["servers"] if len(self.urls) > 1 else [{"url": self.base_url, **health}]
        for entry in servers:
            if entry.get("token_accepted") is False:
                given = "a wrong" if self.headers else "no"
                raise SandboxUnavailable(
                    f"{entry['url']} refuses {given} access token (HTTP 401 on every call): pass the server's token "
                    "(sandbox.token, --sandbox-token or SANDBOX_TOKEN)"
                )
        for entry in servers:
            if entry.get("status") == "down":
                log.warning("sandbox server %s is down, skipped until it answers: %s", entry["url"], entry["error"])
            elif entry.get("status") == "draining":
                log.warning("sandbox server %s is draining: it gets no new work until it is back", entry["url"])
        return self

    def _probe_result(self, server: Server, response: httpx.Response | None, error: Exception | None) -> dict | None:
        """Record a GET /healthz answer; its body when the server answered (even if it refuses our token)."""
        where = f"{server.url}/healthz"
        if error is not None:
            unreachable = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
            self._servers.probed(server, f"cannot reach {where}: {error}", unreachable=unreachable)
            return None
        try:
            body = response.json() if response.status_code == 200 else None
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("status") not in ("ok", "draining"):
            self._servers.probed(server, f"GET {where}: HTTP {response.status_code}: {response.text[:200]}")
            return None
        if body.get("token_accepted") is False:
            self._servers.probed(server, f"{server.url} refuses {'our' if self.headers else 'no'} access token")
        else:
            self._servers.probed(server, None, draining=body["status"] == "draining")
        return body

    def _summary(self, answers: list[dict | None]) -> dict[str, Any]:
        """One server: its /healthz body. Several: sums over those that answered (`capacity` over those that answered
        and are not draining: the sessions and the kernels they hold at once between them), `ready` (how many are
        ready for a new session), plus `servers`, one entry each."""
        if len(self.urls) == 1:
            return answers[0]
        servers = [
            {"url": url, **body} if body is not None else {"url": url, "status": "down", "error": s["last_error"]}
            for url, body, s in zip(self.urls, answers, self._servers.stats(), strict=True)
        ]
        answered = [body for body in answers if body is not None]
        isolations = [body.get("isolation") for body in answered]
        summed = ("sessions", "pool_ready", "kernels_alive", "running", "waiting", "kernel_start_failures")
        taking = [body for body in answered if body.get("status") == "ok"]
        draining = len(answered) - len(taking)
        return {
            "status": "ok" if len(answered) == len(answers) and not draining else "degraded",
            "token_accepted": all(body.get("token_accepted") is not False for body in answered),
            "isolation": isolations[0] if all(i == isolations[0] for i in isolations) else "mixed: see servers",
            **{key: sum(body.get(key) or 0 for body in answered) for key in summed},
            "capacity": {
                key: sum((body.get("capacity") or {}).get(key) or 0 for body in taking)
                for key in ("sessions", "kernels")
            },
            "ready": sum(body.get("ready") is True for body in answered),
            "draining": draining,
            "servers": servers,
        }

    def _lost_result(self, session_id: str, server: Server, error: str, started: float) -> RunResult:
        message = (
            f"session {session_id} lives on sandbox server {server.url}, which failed: {error}. Its state is lost "
            "and the call was not run elsewhere; start a new session"
        )
        return RunResult(
            status="sandbox_error",
            error=ErrorInfo(name="SandboxUnavailable", message=message),
            duration_ms=(time.perf_counter() - started) * 1000,
        )

    def _body(self, code: str, timeout_s: float | None) -> dict[str, Any]:
        return {"code": code} if timeout_s is None else {"code": code, "timeout_s": timeout_s}

    def _http_timeout(self, timeout_s: float | None) -> httpx.Timeout:
        # The server may queue the call and then run it for up to timeout_s (plus interrupt grace).
        return httpx.Timeout(self.timeout_s + (timeout_s or 0.0), connect=5.0)

    # --- call flows (see the class docstring) ---------------------------------------------------------------

    def _pick(self, avoid: set[int], by_sessions: bool) -> Steps[Server | None]:
        yield (self._probe, self._servers.to_probe(all_down=False))
        server = self._servers.pick(avoid, by_sessions)
        if server is None:
            yield (self._probe, self._servers.to_probe(all_down=True, avoid=avoid))
            server = self._servers.pick(avoid, by_sessions)
        return server

    def _spread(
        self, method: str, path: str, *, by_sessions: bool = False, timeout_s: float | None = None, **kw: Any
    ) -> Steps[tuple[Server, httpx.Response]]:
        """A call that may go to any server: (server, response). Nothing ran where it failed before, so it moves on."""
        avoid: set[int] = set()
        attempt, last = 0, None
        while True:
            server = yield from self._pick(avoid, by_sessions)
            if server is None:
                if attempt == self.retries:
                    raise SandboxUnavailable(self._servers.unavailable())
                yield (self._sleep, _delay(attempt, self.backoff_s, last))
                attempt, avoid = attempt + 1, set()
                continue
            response, error = yield (self._send, server, method, path, timeout_s, kw)
            outcome, message = self._servers.settle(server, response, error, method, path)
            if outcome == "ok":
                return server, _check(response, f"{server.url}{path}")
            if outcome == "failed":
                raise SandboxUnavailable(message) from error
            avoid.add(server.index)
            last = response

    def _sticky(
        self, server: Server, method: str, path: str, *, timeout_s: float | None = None, **kw: Any
    ) -> Steps[httpx.Response]:
        """A call that must go to `server` (a session's). Raises _ServerLost when that server failed: the call broke
        after sending, or no connection was made in `retries + 1` tries. Those are backed off like refusals, since
        nothing was sent: a server restarted on its port meanwhile answers (SessionNotFound, as it should). With
        several servers, one known to be unreachable gets one try, so as not to hold up a trainer that has others."""
        one_try = len(self.urls) > 1 and self._servers.known_unreachable(server)
        for attempt in range(self.retries + 1):
            self._servers.begin(server)
            response, error = yield (self._send, server, method, path, timeout_s, kw)
            outcome, message = self._servers.settle(server, response, error, method, path)
            if outcome == "ok":
                return _check(response, f"{server.url}{path}")
            if outcome == "failed" or (outcome == "unreachable" and one_try):
                raise _ServerLost(message) from error
            if attempt < self.retries:
                yield (self._sleep, _delay(attempt, self.backoff_s, response))
        if outcome == "unreachable":
            raise _ServerLost(message) from error
        raise SandboxUnavailable(message)

    def _health_steps(self) -> Steps[dict[str, Any]]:
        for attempt in range(self.retries + 1):
            answers = yield (self._probe, self._servers.claim_all())
            if any(answer is not None for answer in answers):
                return self._summary(answers)
            if attempt < self.retries:
                yield (self._sleep, _delay(attempt, self.backoff_s, None))
        raise SandboxUnavailable(self._servers.unavailable())

    def _create_session_steps(self) -> Steps[str]:
        server, response = yield from self._spread("POST", "/v1/sessions", by_sessions=True)
        self._servers.opened(server, +1)
        return self._session_id(server, response.json()["session_id"])

    def _execute_steps(self, code: str, session_id: str | None, timeout_s: float | None) -> Steps[RunResult]:
        body = self._body(code, timeout_s)
        if not session_id:
            _, response = yield from self._spread("POST", "/v1/execute", timeout_s=timeout_s, json=body)
            return RunResult.model_validate(response.json())
        server, server_id = self._session_of(session_id)
        started = time.perf_counter()
        path = f"/v1/sessions/{server_id}/execute"
        try:
            response = yield from self._sticky(server, "POST", path, timeout_s=timeout_s, json=body)
        except _ServerLost as exc:
            return self._lost_result(session_id, server, str(exc), started)
        return RunResult.model_validate(response.json())

    def _close_session_steps(self, session_id: str) -> Steps[None]:
        try:
            server, server_id = self._session_of(session_id)
            self._servers.opened(server, -1)
            yield from self._sticky(server, "DELETE", f"/v1/sessions/{server_id}")
        except SessionNotFound:
            pass  # already gone (expired, the server restarted, or never made here): nothing to close


class SandboxClient(_Common):
    """Synchronous HTTP client with connection pooling. Use as a context manager or call close().

    `base_url` is one server's URL or a list of them (see the module docstring for how calls are spread).
    """

    def __init__(
        self,
        base_url: str | Sequence[str] = "http://127.0.0.1:8765",
        token: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 60.0,
        max_connections: int = 100,
        down_backoff_s: float = 1.0,
    ):
        super().__init__(base_url, token, retries, backoff_s, timeout_s, down_backoff_s)
        # Pools of their own per server that never close an idle connection before keep-alive expiry: an
        # httpcore race (encode/httpcore#1110, docs/sandbox.md) can otherwise fail a request after it was sent.
        # max_connections is per server.
        self._pools = self._server_pools(httpx.Client, max_connections)
        self._http = self._pools[0].clients[0]  # one of the first server's, for relative requests made on it directly

    def _send(self, server: Server, method: str, path: str, timeout_s: float | None, kw: dict[str, Any]):
        """(response, None) or (None, transport error); `server` was counted in flight and is released here."""
        try:
            with self._pools[server.index].take() as http:
                return http.request(method, server.url + path, timeout=self._http_timeout(timeout_s), **kw), None
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.PoolTimeout):  # our own connection pool is full: no server's fault
                raise SandboxUnavailable(f"{method} {server.url}{path}: no free connection in this client") from exc
            return None, exc
        finally:
            self._servers.end(server)

    def _probe(self, servers: list[Server]) -> list[dict | None]:
        """GET /healthz of each of `servers` (claimed for probing by the caller), one after the other."""
        answers: list[dict | None] = []
        try:
            for server in servers:
                try:
                    with self._pools[server.index].take() as http:
                        response, error = http.get(server.url + "/healthz", timeout=PROBE_TIMEOUT), None
                except httpx.TransportError as exc:
                    response, error = None, exc
                answers.append(self._probe_result(server, response, error))
        finally:
            for server in servers[len(answers) :]:  # interrupted: leave the rest as they were
                self._servers.unprobed(server)
        return answers

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _drive(self, steps: Steps[T]) -> T:
        """Run a call flow to its end, making each call it yields; an exception of one goes back into the flow."""
        send, value = steps.send, None
        while True:
            try:
                call, *args = send(value)
            except StopIteration as done:
                return done.value
            try:
                send, value = steps.send, call(*args)
            except BaseException as exc:
                send, value = steps.throw, exc

    def health(self) -> dict[str, Any]:
        """GET /healthz of every server (retried while none answers); several servers: see `_summary`."""
        return self._drive(self._health_steps())

    def start(self) -> SandboxClient:
        """Check now that the service answers and accepts the token, rather than at the first tool call."""
        return self._checked(self.health())

    def create_session(self) -> str:
        return self._drive(self._create_session_steps())

    def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        """Run `code` in the session, or stateless. A session whose server failed gets status sandbox_error."""
        return self._drive(self._execute_steps(code, session_id, timeout_s))

    def close_session(self, session_id: str) -> None:
        self._drive(self._close_session_steps(session_id))

    def close(self) -> None:
        for pools in self._pools:
            for http in pools.clients:
                http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSandboxClient(_Common):
    """Asynchronous HTTP client with the same methods, as coroutines (one URL or a list, as SandboxClient)."""

    def __init__(
        self,
        base_url: str | Sequence[str] = "http://127.0.0.1:8765",
        token: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 60.0,
        max_connections: int = 256,
        down_backoff_s: float = 1.0,
    ):
        super().__init__(base_url, token, retries, backoff_s, timeout_s, down_backoff_s)
        # max_connections per server, in pools of their own, as in SandboxClient (see there); _http too.
        self._pools = self._server_pools(httpx.AsyncClient, max_connections)
        self._http = self._pools[0].clients[0]

    async def _send(self, server: Server, method: str, path: str, timeout_s: float | None, kw: dict[str, Any]):
        try:
            with self._pools[server.index].take() as http:
                response = await http.request(method, server.url + path, timeout=self._http_timeout(timeout_s), **kw)
            return response, None
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.PoolTimeout):
                raise SandboxUnavailable(f"{method} {server.url}{path}: no free connection in this client") from exc
            return None, exc
        finally:
            self._servers.end(server)

    async def _probe_one(self, server: Server) -> dict | None:
        try:
            with self._pools[server.index].take() as http:
                response, error = await http.get(server.url + "/healthz", timeout=PROBE_TIMEOUT), None
        except httpx.TransportError as exc:
            response, error = None, exc
        except BaseException:  # cancelled: leave it as it was
            self._servers.unprobed(server)
            raise
        return self._probe_result(server, response, error)

    async def _probe(self, servers: list[Server]) -> list[dict | None]:
        return list(await asyncio.gather(*(self._probe_one(server) for server in servers)))

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _drive(self, steps: Steps[T]) -> T:
        """SandboxClient._drive with each call awaited."""
        send, value = steps.send, None
        while True:
            try:
                call, *args = send(value)
            except StopIteration as done:
                return done.value
            try:
                send, value = steps.send, await call(*args)
            except BaseException as exc:
                send, value = steps.throw, exc

    async def health(self) -> dict[str, Any]:
        return await self._drive(self._health_steps())

    async def start(self) -> AsyncSandboxClient:
        """Check now that the service answers and accepts the token, rather than at the first tool call."""
        return self._checked(await self.health())

    async def create_session(self) -> str:
        return await self._drive(self._create_session_steps())

    async def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        return await self._drive(self._execute_steps(code, session_id, timeout_s))

    async def close_session(self, session_id: str) -> None:
        await self._drive(self._close_session_steps(session_id))

    async def close(self) -> None:
        await asyncio.gather(*(http.aclose() for pools in self._pools for http in pools.clients))

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
