"""Stateful sessions, each holding one kernel of the pool, and the stateless run on a pooled kernel.

A session keeps its variables across calls until it is closed, expires or the process holding them dies (the next
call then starts from a clean interpreter again). With `pool.clean_state: fork` the variables live in the session's
worker, forked from its kernel's clean template by the first call; closing the session ends the worker and gives the
kernel back to the pool. With `reset` they live in the kernel itself, which retires with the session. Knows
nothing about HTTP: the service (app.py) and the in-process client (inprocess.py) both call these.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from stare_sandbox.kernel import Kernel, SandboxError
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.schemas import RunResult

log = logging.getLogger("sandbox")


@dataclass
class Session:
    kernel: Kernel | None
    """None after its kernel died: the next call takes a new one (its slot may be the only one: max_kernels)."""
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionStore:
    """Stateful sessions: one kernel each, closed on request, on expiry and at shutdown."""

    def __init__(self, pool: KernelPool, max_sessions: int, idle_s: float):
        self.pool = pool
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._sessions: dict[str, Session] = {}
        self._opening = 0  # sessions waiting for their kernel: they count against max_sessions

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def opening(self) -> int:
        """Sessions being created, waiting for their kernel."""
        return self._opening

    def ids(self) -> list[str]:
        return list(self._sessions)

    async def create(self, wait_s: float | None = None) -> str:
        """A new session's id, once it has a kernel (waiting `wait_s`, default queue_wait_s: else KernelsBusy)."""
        if len(self._sessions) + self._opening >= self.max_sessions:
            raise SandboxError(f"the session limit ({self.max_sessions}) is reached")
        self._opening += 1
        try:
            kernel = await self.pool.acquire(wait_s, stateless=self.pool.settings.forks)
        finally:
            self._opening -= 1
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = Session(kernel, time.monotonic())
        return session_id

    def exists(self, session_id: str) -> bool:
        return session_id in self._sessions

    async def execute(self, session_id: str, code: str, timeout_s: float, wait_s: float | None = None) -> RunResult:
        """Run `code` in the session; a session whose kernel died first waits `wait_s` for a new one (KernelsBusy)."""
        session = self._sessions[session_id]
        async with session.lock:
            session.last_used = time.monotonic()
            settings = self.pool.settings
            if session.kernel is None:  # KernelsBusy here: the code has not run, the call may be retried
                session.kernel = await self.pool.acquire(wait_s, stateless=settings.forks)
            worker = "session" if settings.forks else None
            result = await session.kernel.execute(code, timeout_s, settings, worker=worker)
            if session.kernel.dead:
                # Its slot is freed first and a new kernel taken only by the next call: acquiring one here could
                # wait for the very slot the dead kernel holds (max_kernels) and lose this call's result.
                dead, session.kernel = session.kernel, None
                await self.pool.discard(dead, "died")
            session.last_used = time.monotonic()
            return result

    async def close(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        async with session.lock:
            kernel = session.kernel
            if kernel is None:
                return True
            if not self.pool.settings.forks:
                await self.pool.discard(kernel, "session")
                return True
            # The worker ends with the session; the kernel, which never ran the session's code, serves again.
            kernel.runs += 1
            try:
                if not kernel.dead:
                    await kernel.execute("", 30.0, self.pool.settings, user=False, worker="end")
            except BaseException:
                kernel.dead = True
                raise
            finally:
                self.pool.give_back_later(kernel)
        return True

    async def expire(self) -> int:
        cutoff = time.monotonic() - self.idle_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < cutoff and not s.lock.locked()]
        for sid in stale:
            await self.close(sid)
        return len(stale)

    async def close_all(self) -> None:
        await asyncio.gather(*(self.close(sid) for sid in list(self._sessions)), return_exceptions=True)


def call_timeout(settings: PoolSettings, requested: float | None) -> tuple[float, bool]:
    """The limit a call runs under: its own timeout_s or the default, capped at max_timeout_s; and whether capped."""
    wanted = requested or settings.default_timeout_s
    return min(wanted, settings.max_timeout_s), wanted > settings.max_timeout_s


async def run_stateless(
    pool: KernelPool, code: str, timeout_s: float, wait_s: float | None = None, output_limit_bytes: int | None = None
) -> RunResult:
    """Run `code` on a pooled kernel. A call that failed before any of its code started (its kernel's template had
    died, or the worker handed the call died before it began: the result says so) runs once more, on another kernel
    where its own was retired; never a call whose code may have started, which could repeat what it did (e.g. kill
    a second kernel's template)."""
    result = await _run_once(pool, code, timeout_s, wait_s, output_limit_bytes)
    if result._never_ran:
        log.warning("a stateless call failed before its code started (%s); it runs once more", result.error)
        pool.calls_rerun += 1
        result = await _run_once(pool, code, timeout_s, wait_s, output_limit_bytes)
    return result


async def _run_once(
    pool: KernelPool, code: str, timeout_s: float, wait_s: float | None, output_limit_bytes: int | None
) -> RunResult:
    kernel = await pool.acquire(wait_s, stateless=True)
    kernel.runs += 1
    worker = "call" if pool.settings.forks else None
    try:
        return await kernel.execute(
            code, timeout_s, pool.settings, output_limit_bytes=output_limit_bytes, worker=worker
        )
    except BaseException:
        kernel.dead = True  # cancelled mid-run, the code may still be running: replace the kernel, do not reset it
        raise
    finally:
        pool.give_back_later(kernel)
