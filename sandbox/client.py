"""Clients of the sandbox: over HTTP (sync and async) and in-process, with one interface.

Retries: a call is retried with exponential backoff only when it certainly did not run -- the
connection could not be made, or the server answered 429/503 (overloaded, no kernel). A user-code
failure is a normal RunResult and is never retried; neither is a call whose connection broke after
it was sent (it may have run, and a stateful session must not run code twice). Those raise
`SandboxUnavailable`, which callers treat as an infrastructure failure, not a wrong answer.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from sandbox.schemas import RunResult

T = TypeVar("T")
RETRY_STATUS = {429, 503}
KEEPALIVE_S = 10.0
"""Idle connections are dropped after this, well before the server closes them (its keep-alive is 60 s): a
request on a connection the server closes at that moment fails after sending and cannot be retried safely.
(Both httpx and uvicorn default to 5 s, so under load such races happened.)"""


class SandboxUnavailable(RuntimeError):
    """The service could not be reached or kept refusing; the code did not run (or its fate is unknown)."""


class SessionNotFound(KeyError):
    """The session id is unknown: closed, expired, or from a restarted server."""


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
        raise SessionNotFound(response.json().get("detail", url))
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text[:200]
        raise SandboxUnavailable(f"{response.request.method} {url}: HTTP {response.status_code}: {detail}")
    return response


def check_url(url: str) -> str:
    """`url` without a trailing slash, or ValueError saying what is wrong with it (scheme, host)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = "http://" + url.strip().split("://")[-1] if url.strip() else "http://127.0.0.1:8765"
        raise ValueError(f"URL {url!r} must be http(s)://HOST[:PORT], e.g. {example!r}")
    return url.strip().rstrip("/")


class _Common:
    def __init__(self, base_url: str, token: str | None, retries: int, backoff_s: float, timeout_s: float):
        self.base_url = check_url(base_url)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s

    def _checked(self, health: dict[str, Any]) -> Any:
        if health.get("token_accepted") is False:
            given = "a wrong" if self.headers else "no"
            raise SandboxUnavailable(
                f"{self.base_url} refuses {given} access token (HTTP 401 on every call): pass the server's token "
                "(sandbox.token, --sandbox-token or SANDBOX_TOKEN)"
            )
        return self

    def _body(self, code: str, timeout_s: float | None) -> dict[str, Any]:
        return {"code": code} if timeout_s is None else {"code": code, "timeout_s": timeout_s}

    def _http_timeout(self, timeout_s: float | None) -> httpx.Timeout:
        # The server may queue the call and then run it for up to timeout_s (plus interrupt grace).
        return httpx.Timeout(self.timeout_s + (timeout_s or 0.0), connect=5.0)

    def _settle(
        self, attempt: int, method: str, url: str, response: httpx.Response | None, error: httpx.TransportError | None
    ) -> httpx.Response | None:
        """The response to return, or None to retry after a backoff; raises when retrying is not allowed."""
        if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):  # never sent: safe to retry
            if attempt == self.retries:
                raise SandboxUnavailable(f"cannot reach {self.base_url}{url}: {error}") from error
            return None
        if error is not None:  # sent, fate unknown: a retry could run the code twice
            raise SandboxUnavailable(f"{method} {self.base_url}{url} failed after sending: {error}") from error
        if response.status_code not in RETRY_STATUS or attempt == self.retries:
            return _check(response, url)
        return None


class SandboxClient(_Common):
    """Synchronous HTTP client with connection pooling. Use as a context manager or call close()."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8765",
        token: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 60.0,
    ):
        super().__init__(base_url, token, retries, backoff_s, timeout_s)
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        self._http = httpx.Client(base_url=self.base_url, headers=self.headers, limits=limits)

    def _request(self, method: str, url: str, *, timeout_s: float | None = None, **kw: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = self._http.request(method, url, timeout=self._http_timeout(timeout_s), **kw)
            except httpx.TransportError as exc:
                error = exc
            settled = self._settle(attempt, method, url, response, error)
            if settled is not None:
                return settled
            time.sleep(_delay(attempt, self.backoff_s, response))
        raise AssertionError("unreachable")

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/healthz").json()

    def start(self) -> SandboxClient:
        """Check now that the service answers and accepts the token, rather than at the first tool call."""
        return self._checked(self.health())

    def create_session(self) -> str:
        return self._request("POST", "/v1/sessions").json()["session_id"]

    def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        url = f"/v1/sessions/{session_id}/execute" if session_id else "/v1/execute"
        response = self._request("POST", url, timeout_s=timeout_s, json=self._body(code, timeout_s))
        return RunResult.model_validate(response.json())

    def close_session(self, session_id: str) -> None:
        try:
            self._request("DELETE", f"/v1/sessions/{session_id}")
        except SessionNotFound:
            pass  # already gone (expired, or the server restarted): nothing to close

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSandboxClient(_Common):
    """Asynchronous HTTP client with the same methods, as coroutines."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8765",
        token: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 60.0,
        max_connections: int = 256,
    ):
        super().__init__(base_url, token, retries, backoff_s, timeout_s)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=KEEPALIVE_S
        )
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, limits=limits)

    async def _request(self, method: str, url: str, *, timeout_s: float | None = None, **kw: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = await self._http.request(method, url, timeout=self._http_timeout(timeout_s), **kw)
            except httpx.TransportError as exc:
                error = exc
            settled = self._settle(attempt, method, url, response, error)
            if settled is not None:
                return settled
            await asyncio.sleep(_delay(attempt, self.backoff_s, response))
        raise AssertionError("unreachable")

    async def health(self) -> dict[str, Any]:
        return (await self._request("GET", "/healthz")).json()

    async def start(self) -> AsyncSandboxClient:
        """Check now that the service answers and accepts the token, rather than at the first tool call."""
        return self._checked(await self.health())

    async def create_session(self) -> str:
        return (await self._request("POST", "/v1/sessions")).json()["session_id"]

    async def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        url = f"/v1/sessions/{session_id}/execute" if session_id else "/v1/execute"
        response = await self._request("POST", url, timeout_s=timeout_s, json=self._body(code, timeout_s))
        return RunResult.model_validate(response.json())

    async def close_session(self, session_id: str) -> None:
        try:
            await self._request("DELETE", f"/v1/sessions/{session_id}")
        except SessionNotFound:
            pass

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class InProcessClient:
    """The async client's interface over a kernel pool in this process: no server, no HTTP.

    For the single-process (local) backend. `await client.start()` (or `async with`) first.
    """

    def __init__(
        self, settings: Any = None, *, max_sessions: int = 1024, session_idle_s: float = 3600.0, max_running: int = 8
    ):
        from sandbox.kernels import KernelPool, PoolSettings, SessionStore

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
        return await self._guard(self.sessions.create)

    async def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult:
        from sandbox.kernels import SandboxError, call_timeout, run_stateless

        timeout, capped = call_timeout(self.pool.settings, timeout_s)
        if session_id is not None and not self.sessions.exists(session_id):
            raise SessionNotFound(session_id)
        started = time.perf_counter()
        try:
            if session_id is None:
                async with self._running:
                    result = await run_stateless(self.pool, code, timeout)
            else:
                result = await self.sessions.execute(session_id, code, timeout)
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

    @staticmethod
    async def _guard(call: Callable[[], Awaitable[T]]) -> T:
        from sandbox.kernels import SandboxError

        try:
            return await call()
        except SandboxError as exc:
            raise SandboxUnavailable(str(exc)) from exc
