"""The in-process client: the async HTTP client's interface over a kernel pool in this process, no server.

For the single-process (local) backend and the tests: a call runs on a pooled kernel (sessions.py, pool.py) as
the service would run it, and a failure to get a kernel is a SandboxUnavailable, as from an HTTP client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from stare_sandbox.client import SandboxUnavailable, SessionNotFound
from stare_sandbox.kernel import KernelsBusy, SandboxError
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.schemas import RunResult
from stare_sandbox.sessions import SessionStore, call_timeout, run_stateless

T = TypeVar("T")


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
        for attempt in range(self.busy_retries + 1):
            try:
                return await call()
            except KernelsBusy:
                if attempt == self.busy_retries:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    async def _guard(call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except SandboxError as exc:
            raise SandboxUnavailable(str(exc)) from exc
