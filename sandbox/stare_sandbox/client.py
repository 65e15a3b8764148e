"""Clients of the sandbox: over HTTP (sync and async) and in-process, with one interface.

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
thread-safe). InProcessClient has no servers: one pool in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import httpx

from stare_sandbox.schemas import ErrorInfo, RunResult

T = TypeVar("T")
H = TypeVar("H", httpx.Client, httpx.AsyncClient)
log = logging.getLogger("sandbox.client")
RETRY_STATUS = {429, 503}
KEEPALIVE_S = 10.0
"""Idle connections are dropped after this, well before the server closes them (its keep-alive is 60 s): a
request on a connection the server closes at that moment fails after sending and cannot be retried safely.
(Both httpx and uvicorn default to 5 s, so under load such races happened.)"""
DOWN_AFTER_REFUSALS = 3
"""A server that answers this many calls in a row with 429/503 is skipped (marked down) until re-probed."""
MAX_DOWN_S = 30.0
"""Longest pause before a down server is probed again."""
POOL_CONNECTIONS = 16
"""Most connections in one httpx pool: a server's connections are split over pools of this size. httpcore's pool
looks at every connection for each idle one whenever a request starts or ends, so its cost per call grows with
the square of its size: measured with a stand-in server (benchmarks/bench_client.py), one pool of 128 busy
connections cost 26 ms of client CPU per call against 1.2 ms split into pools of 16."""
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


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail"))
    except (ValueError, AttributeError):
        return response.text[:200]


def _check(response: httpx.Response, url: str) -> httpx.Response:
    if response.status_code == 404 and "/sessions/" in url:
        raise SessionNotFound(_detail(response) or url)
    if response.status_code >= 400:
        raise SandboxUnavailable(f"{response.request.method} {url}: HTTP {response.status_code}: {_detail(response)}")
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


@dataclass(eq=False)
class _Server:
    """What this client knows about one server. Changed only under `_Servers.lock`."""

    index: int
    url: str
    down_for: float
    """Pause before the next probe, should this server go down; doubles while it stays down."""
    up: bool = True
    unreachable: bool = False
    """Down because it could not be connected to: with several servers, a session call there gets one try, not the
    retries, until the next probe."""
    retry_at: float = 0.0
    """When down: monotonic time of the next probe."""
    probing: bool = False
    last_error: str = ""
    refusals: int = 0
    """429/503 answers in a row."""
    in_flight: int = 0
    sessions: int = 0
    """Sessions this client opened there and has not closed."""
    calls: int = 0
    """Requests this client sent there (probes excluded)."""


Outcome = Literal["ok", "refused", "unreachable", "failed"]
"""ok: an answer to hand on (2xx, or a 4xx `_check` reports); refused: 429/503 with Retry-After, nothing ran;
unreachable: no connection or 503 without Retry-After, nothing ran; failed: broken after sending or 5xx,
the call may have run."""


class _Servers:
    """The server list and its bookkeeping: choice by load, down marks, backoff. No I/O here."""

    def __init__(self, urls: tuple[str, ...], down_backoff_s: float):
        self.list = [_Server(i, url, down_backoff_s) for i, url in enumerate(urls)]
        self.down_backoff_s = down_backoff_s
        self.lock = threading.Lock()
        self._turn = 0

    def pick(self, avoid: set[int], by_sessions: bool) -> _Server | None:
        """The least loaded up server not in `avoid`, counted as in flight; ties in turn. None: no such server."""
        with self.lock:
            up = [s for s in self.list if s.up and s.index not in avoid]
            if not up:
                return None
            load = {s.index: (s.sessions, s.in_flight) if by_sessions else (s.in_flight,) for s in up}
            least = min(load.values())
            tied = [s for s in up if load[s.index] == least]
            server = min(tied, key=lambda s: (s.index - self._turn) % len(self.list))
            self._turn = server.index + 1
            server.in_flight += 1
            server.calls += 1
            return server

    def begin(self, server: _Server) -> None:
        with self.lock:
            server.in_flight += 1
            server.calls += 1

    def end(self, server: _Server) -> None:
        with self.lock:
            server.in_flight -= 1

    def to_probe(self, all_down: bool, avoid: set[int] = frozenset()) -> list[_Server]:
        """Down servers to probe now, marked as being probed: those whose pause is over, or (all_down, when no
        server is up) every down one not in `avoid`."""
        now = time.monotonic()
        with self.lock:
            if all_down and any(s.up for s in self.list):
                return []
            due = [
                s
                for s in self.list
                if not s.up and not s.probing and s.index not in avoid and (all_down or now >= s.retry_at)
            ]
            for s in due:
                s.probing = True
            return due

    def claim_all(self) -> list[_Server]:
        """Every server, marked as being probed (for health(), which wants each one's answer)."""
        with self.lock:
            for s in self.list:
                s.probing = True
            return list(self.list)

    def probed(self, server: _Server, error: str | None, *, unreachable: bool = False) -> None:
        with self.lock:
            server.probing = False
            if error is None:
                server.up, server.unreachable, server.refusals = True, False, 0
            else:
                self._down(server, error, unreachable, again=True)

    def unprobed(self, server: _Server) -> None:
        """A probe was abandoned (cancelled): leave the server as it was."""
        with self.lock:
            server.probing = False

    def settle(
        self, server: _Server, response: httpx.Response | None, error: Exception | None, method: str, path: str
    ) -> tuple[Outcome, str]:
        """Classify an answer (or transport error) of `server` to `method path`; update what is known of it."""
        where = f"{method} {server.url}{path}"
        with self.lock:
            if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
                message = f"cannot reach {server.url}{path}: {error}"
                self._down(server, message, unreachable=True)
                return "unreachable", message
            if error is not None:
                message = f"{where} failed after sending: {type(error).__name__}: {error}"
                self._down(server, message, unreachable=False)
                return "failed", message
            status = response.status_code
            message = f"{where}: HTTP {status}: {_detail(response)}"
            if status in RETRY_STATUS and (status == 429 or response.headers.get("retry-after")):
                server.refusals += 1
                server.last_error = message
                if server.refusals >= DOWN_AFTER_REFUSALS:
                    self._down(server, f"{message} ({server.refusals} refusals in a row)", unreachable=False)
                return "refused", message
            if status == 503:  # without Retry-After: a proxy saying the server is gone; the call was not run
                self._down(server, message, unreachable=True)
                return "unreachable", message
            if status >= 500:
                self._down(server, message, unreachable=False)
                return "failed", message
            server.up, server.unreachable, server.refusals = True, False, 0
            server.down_for = self.down_backoff_s
            return "ok", ""

    def _down(self, server: _Server, error: str, unreachable: bool, again: bool = False) -> None:
        server.last_error = error
        server.unreachable = unreachable
        if server.up or again:  # a second failure seen while already down does not push the probe further off
            server.up = False
            server.retry_at = time.monotonic() + server.down_for
            server.down_for = min(2 * server.down_for, MAX_DOWN_S)

    def known_unreachable(self, server: _Server) -> bool:
        """Whether a connection to `server` failed and no probe has answered since (until its next probe)."""
        with self.lock:
            return not server.up and server.unreachable and time.monotonic() < server.retry_at

    def opened(self, server: _Server, delta: int) -> None:
        with self.lock:
            server.sessions = max(0, server.sessions + delta)

    def unavailable(self) -> SandboxUnavailable:
        """The error when no server took a call: each server's last error (the one error with one server)."""
        with self.lock:
            errors = [s.last_error or f"{s.url}: no answer" for s in self.list]
        if len(errors) == 1:
            return SandboxUnavailable(errors[0])
        listed = "; ".join(f"[{i}] {error}" for i, error in enumerate(errors))
        return SandboxUnavailable(f"none of the {len(errors)} sandbox servers took the call: {listed}")

    def stats(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {
                    "url": s.url,
                    "up": s.up,
                    "calls": s.calls,
                    "in_flight": s.in_flight,
                    "sessions": s.sessions,
                    "last_error": s.last_error,
                }
                for s in self.list
            ]


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
        self._servers = _Servers(self.urls, down_backoff_s)

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

    def _session_id(self, server: _Server, server_id: str) -> str:
        return server_id if len(self.urls) == 1 else f"{server.index}-{server_id}"

    def _session_of(self, session_id: str) -> tuple[_Server, str]:
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
        return self

    def _probe_result(self, server: _Server, response: httpx.Response | None, error: Exception | None) -> dict | None:
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
        if not isinstance(body, dict) or body.get("status") != "ok":
            self._servers.probed(server, f"GET {where}: HTTP {response.status_code}: {response.text[:200]}")
            return None
        if body.get("token_accepted") is False:
            self._servers.probed(server, f"{server.url} refuses {'our' if self.headers else 'no'} access token")
        else:
            self._servers.probed(server, None)
        return body

    def _health(self, answers: list[dict | None]) -> dict[str, Any]:
        """One server: its /healthz body. Several: sums over those that answered, plus `servers`, one entry each."""
        if len(self.urls) == 1:
            return answers[0]
        servers = [
            {"url": url, **body} if body is not None else {"url": url, "status": "down", "error": s["last_error"]}
            for url, body, s in zip(self.urls, answers, self._servers.stats(), strict=True)
        ]
        answered = [body for body in answers if body is not None]
        isolations = [body.get("isolation") for body in answered]
        summed = ("sessions", "pool_ready", "kernels_alive", "running", "waiting", "kernel_start_failures")
        return {
            "status": "ok" if len(answered) == len(answers) else "degraded",
            "token_accepted": all(body.get("token_accepted") is not False for body in answered),
            "isolation": isolations[0] if all(i == isolations[0] for i in isolations) else "mixed: see servers",
            **{key: sum(body.get(key) or 0 for body in answered) for key in summed},
            "servers": servers,
        }

    def _lost_result(self, session_id: str, server: _Server, error: str, started: float) -> RunResult:
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
        # Connection pools of their own per server (_Pools), none of whose idle connections is closed before
        # keep-alive expiry (max_keepalive_connections = max_connections). httpcore 1.0.9 can close an idle
        # connection it has just handed to a queued request, after that request was sent (encode/httpcore#1110):
        # it fails after sending (ReadError) although the server ran it. A pool shared by all servers did that when
        # full, closing an idle connection to one server to open one to another (a session creation lost in about
        # one run in five of tests/sandbox/test_soak.py), and so does the clean-up of connections beyond
        # max_keepalive_connections. Keep-alive expiry can still do it, in the moment between a request being
        # given a connection and its start.
        # max_connections is per server.
        self._pools = self._server_pools(httpx.Client, max_connections)
        self._http = self._pools[0].clients[0]  # one of the first server's, for relative requests made on it directly

    def _send(self, server: _Server, method: str, path: str, timeout_s: float | None, **kw: Any):
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

    def _probe(self, servers: list[_Server]) -> list[dict | None]:
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

    def _pick(self, avoid: set[int], by_sessions: bool) -> _Server | None:
        self._probe(self._servers.to_probe(all_down=False))
        server = self._servers.pick(avoid, by_sessions)
        if server is None:
            self._probe(self._servers.to_probe(all_down=True, avoid=avoid))
            server = self._servers.pick(avoid, by_sessions)
        return server

    def _spread(self, method: str, path: str, *, by_sessions: bool = False, timeout_s: float | None = None, **kw: Any):
        """A call that may go to any server: (server, response). Nothing ran where it failed before, so it moves on."""
        avoid: set[int] = set()
        attempt, last = 0, None
        while True:
            server = self._pick(avoid, by_sessions)
            if server is None:
                if attempt == self.retries:
                    raise self._servers.unavailable()
                time.sleep(_delay(attempt, self.backoff_s, last))
                attempt, avoid = attempt + 1, set()
                continue
            response, error = self._send(server, method, path, timeout_s, **kw)
            outcome, message = self._servers.settle(server, response, error, method, path)
            if outcome == "ok":
                return server, _check(response, f"{server.url}{path}")
            if outcome == "failed":
                raise SandboxUnavailable(message) from error
            avoid.add(server.index)
            last = response

    def _sticky(self, server: _Server, method: str, path: str, *, timeout_s: float | None = None, **kw: Any):
        """A call that must go to `server` (a session's). Raises _ServerLost when that server failed: the call broke
        after sending, or no connection was made in `retries + 1` tries. Those are backed off like refusals, since
        nothing was sent: a server restarted on its port meanwhile answers (SessionNotFound, as it should). With
        several servers, one known to be unreachable gets one try, so as not to hold up a trainer that has others."""
        one_try = len(self.urls) > 1 and self._servers.known_unreachable(server)
        for attempt in range(self.retries + 1):
            self._servers.begin(server)
            response, error = self._send(server, method, path, timeout_s, **kw)
            outcome, message = self._servers.settle(server, response, error, method, path)
            if outcome == "ok":
                return _check(response, f"{server.url}{path}")
            if outcome == "failed" or (outcome == "unreachable" and one_try):
                raise _ServerLost(message) from error
            if attempt < self.retries:
                time.sleep(_delay(attempt, self.backoff_s, response))
        if outcome == "unreachable":
            raise _ServerLost(message) from error
        raise SandboxUnavailable(message)

    def health(self) -> dict[str, Any]:
        """GET /healthz of every server (retried while none answers); several servers: see `_health`."""
        for attempt in range(self.retries + 1):
            answers = self._probe(self._servers.claim_all())
            if any(answer is not None for answer in answers):
                return self._health(answers)
            if attempt < self.retries:
                time.sleep(_delay(attempt, self.backoff_s, None))
        raise self._servers.unavailable()

    def start(self) -> SandboxClient:
        """Check now that the service answers and accepts the token, rather than at the first tool call."""
        return self._checked(self.health())

    def create_session(self) -> str:
        server, response = self._spread("POST", "/v1/sessions", by_sessions=True)
        self._servers.opened(server, +1)
        return self._session_id(server, response.json()["session_id"])

    def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        """Run `code` in the session, or stateless. A session whose server failed gets status sandbox_error."""
        body = self._body(code, timeout_s)
        if not session_id:
            _, response = self._spread("POST", "/v1/execute", timeout_s=timeout_s, json=body)
            return RunResult.model_validate(response.json())
        server, server_id = self._session_of(session_id)
        started = time.perf_counter()
        path = f"/v1/sessions/{server_id}/execute"
        try:
            response = self._sticky(server, "POST", path, timeout_s=timeout_s, json=body)
        except _ServerLost as exc:
            return self._lost_result(session_id, server, str(exc), started)
        return RunResult.model_validate(response.json())

    def close_session(self, session_id: str) -> None:
        try:
            server, server_id = self._session_of(session_id)
            self._servers.opened(server, -1)
            self._sticky(server, "DELETE", f"/v1/sessions/{server_id}")
        except SessionNotFound:
            pass  # already gone (expired, the server restarted, or never made here): nothing to close

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

    async def _send(self, server: _Server, method: str, path: str, timeout_s: float | None, **kw: Any):
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

    async def _probe_one(self, server: _Server) -> dict | None:
        try:
            with self._pools[server.index].take() as http:
                response, error = await http.get(server.url + "/healthz", timeout=PROBE_TIMEOUT), None
        except httpx.TransportError as exc:
            response, error = None, exc
        except BaseException:  # cancelled: leave it as it was
            self._servers.unprobed(server)
            raise
        return self._probe_result(server, response, error)

    async def _probe(self, servers: list[_Server]) -> list[dict | None]:
        return list(await asyncio.gather(*(self._probe_one(server) for server in servers)))

    async def _pick(self, avoid: set[int], by_sessions: bool) -> _Server | None:
        await self._probe(self._servers.to_probe(all_down=False))
        server = self._servers.pick(avoid, by_sessions)
        if server is None:
            await self._probe(self._servers.to_probe(all_down=True, avoid=avoid))
            server = self._servers.pick(avoid, by_sessions)
        return server

    async def _spread(
        self, method: str, path: str, *, by_sessions: bool = False, timeout_s: float | None = None, **kw: Any
    ):
        avoid: set[int] = set()
        attempt, last = 0, None
        while True:
            server = await self._pick(avoid, by_sessions)
            if server is None:
                if attempt == self.retries:
                    raise self._servers.unavailable()
                await asyncio.sleep(_delay(attempt, self.backoff_s, last))
                attempt, avoid = attempt + 1, set()
                continue
            response, error = await self._send(server, method, path, timeout_s, **kw)
            outcome, message = self._servers.settle(server, response, error, method, path)
            if outcome == "ok":
                return server, _check(response, f"{server.url}{path}")
            if outcome == "failed":
                raise SandboxUnavailable(message) from error
            avoid.add(server.index)
            last = response

    async def _sticky(self, server: _Server, method: str, path: str, *, timeout_s: float | None = None, **kw: Any):
        one_try = len(self.urls) > 1 and self._servers.known_unreachable(server)
        for attempt in range(self.retries + 1):
            self._servers.begin(server)
            response, error = await self._send(server, method, path, timeout_s, **kw)
            outcome, message = self._servers.settle(server, response, error, method, path)
            if outcome == "ok":
                return _check(response, f"{server.url}{path}")
            if outcome == "failed" or (outcome == "unreachable" and one_try):
                raise _ServerLost(message) from error
            if attempt < self.retries:
                await asyncio.sleep(_delay(attempt, self.backoff_s, response))
        if outcome == "unreachable":
            raise _ServerLost(message) from error
        raise SandboxUnavailable(message)

    async def health(self) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            answers = await self._probe(self._servers.claim_all())
            if any(answer is not None for answer in answers):
                return self._health(answers)
            if attempt < self.retries:
                await asyncio.sleep(_delay(attempt, self.backoff_s, None))
        raise self._servers.unavailable()

    async def start(self) -> AsyncSandboxClient:
        """Check now that the service answers and accepts the token, rather than at the first tool call."""
        return self._checked(await self.health())

    async def create_session(self) -> str:
        server, response = await self._spread("POST", "/v1/sessions", by_sessions=True)
        self._servers.opened(server, +1)
        return self._session_id(server, response.json()["session_id"])

    async def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        body = self._body(code, timeout_s)
        if not session_id:
            _, response = await self._spread("POST", "/v1/execute", timeout_s=timeout_s, json=body)
            return RunResult.model_validate(response.json())
        server, server_id = self._session_of(session_id)
        started = time.perf_counter()
        path = f"/v1/sessions/{server_id}/execute"
        try:
            response = await self._sticky(server, "POST", path, timeout_s=timeout_s, json=body)
        except _ServerLost as exc:
            return self._lost_result(session_id, server, str(exc), started)
        return RunResult.model_validate(response.json())

    async def close_session(self, session_id: str) -> None:
        try:
            server, server_id = self._session_of(session_id)
            self._servers.opened(server, -1)
            await self._sticky(server, "DELETE", f"/v1/sessions/{server_id}")
        except SessionNotFound:
            pass

    async def close(self) -> None:
        await asyncio.gather(*(http.aclose() for pools in self._pools for http in pools.clients))

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class InProcessClient:
    """The async client's interface over a kernel pool in this process: no server, no HTTP.

    For the single-process (local) backend. `await client.start()` (or `async with`) first. It has no servers,
    so there is no list to take: for more kernels, raise the pool's sizes (or run services and list their URLs).
    """

    def __init__(
        self,
        settings: Any = None,
        *,
        max_sessions: int = 1024,
        session_idle_s: float = 3600.0,
        max_running: int = 8,
        busy_retries: int = 3,
    ):
        from stare_sandbox.pool import KernelPool, PoolSettings
        from stare_sandbox.sessions import SessionStore

        # A call that got no kernel within queue_wait_s never ran its code: wait again, as the HTTP clients
        # retry the service's 503, up to busy_retries more times (a slow machine, not a broken pool).
        self.busy_retries = busy_retries

        self.pool = KernelPool(settings or PoolSettings())
        self.sessions = SessionStore(self.pool, max_sessions, session_idle_s)
        # Stateless calls beyond this wait for a running one to finish (as the service's admission does):
        # a burst of calls then reuses warm kernels instead of starting one kernel per call.
        self._running = asyncio.Semaphore(max_running)

    async def start(self) -> InProcessClient:
        await self.pool.start()
        return self

    async def health(self) -> dict[str, Any]:
        isolation = self.pool.isolation.as_dict() if self.pool.isolation else None
        return {"status": "ok", "isolation": isolation, "sessions": len(self.sessions)}

    async def create_session(self) -> str:
        return await self._guard(lambda: self._until_a_kernel(self.sessions.create))

    async def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        from stare_sandbox.kernel import SandboxError
        from stare_sandbox.sessions import call_timeout, run_stateless

        timeout, capped = call_timeout(self.pool.settings, timeout_s)
        if session_id is not None and not self.sessions.exists(session_id):
            raise SessionNotFound(session_id)
        started = time.perf_counter()
        try:
            if session_id is None:
                async with self._running:
                    result = await self._until_a_kernel(lambda: run_stateless(self.pool, code, timeout))
            else:
                result = await self._until_a_kernel(lambda: self.sessions.execute(session_id, code, timeout))
        except SandboxError as exc:  # as the HTTP service answers it
            elapsed = (time.perf_counter() - started) * 1000
            result = RunResult(
                status="sandbox_error", error={"name": "SandboxError", "message": str(exc)}, duration_ms=elapsed
            )
        except KeyError:
            raise SessionNotFound(session_id) from None
        return result.model_copy(update={"timeout_s": timeout, "timeout_capped": capped})

    async def close_session(self, session_id: str) -> None:
        await self.sessions.close(session_id)

    async def close(self) -> None:
        """Close the sessions, then stop every kernel and remove the scratch dirs (also if cancelled meanwhile)."""
        try:
            await self.sessions.close_all()
        finally:
            await self.pool.close()

    async def __aenter__(self) -> InProcessClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _until_a_kernel(self, call: Callable[[], Awaitable[T]]) -> T:
        from stare_sandbox.kernel import KernelsBusy

        for attempt in range(self.busy_retries + 1):
            try:
                return await call()
            except KernelsBusy:
                if attempt == self.busy_retries:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    async def _guard(call: Callable[[], Awaitable[T]]) -> T:
        from stare_sandbox.kernel import SandboxError

        try:
            return await call()
        except SandboxError as exc:
            raise SandboxUnavailable(str(exc)) from exc
