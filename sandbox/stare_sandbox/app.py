"""The HTTP service: FastAPI routes over the kernel pool and the session store.

Admission control keeps the service responsive under load: at most `max_running` calls run at
once, at most `max_waiting` more wait; beyond that a call gets 429 with Retry-After at once instead
of hanging, and one that has not started within queue_wait_s gets 503 with Retry-After. With a token
configured, every route but /healthz and /readyz needs `Authorization: Bearer <token>`. While the server drains
(drain.py, after SIGTERM) new sessions and stateless calls get 503 with the DRAINING_HEADER; /healthz and /readyz
say whether a new session would be taken now (readiness).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import os
import resource
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from stare_sandbox import sandboxfusion
from stare_sandbox.drain import Drain
from stare_sandbox.kernel import KernelsBusy, SandboxError
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.schemas import (
    DRAINING_HEADER,
    ErrorResponse,
    ExecuteRequest,
    RunCodeRequest,
    RunCodeResponse,
    RunResult,
    SessionCreated,
)
from stare_sandbox.sessions import SessionStore, call_timeout, run_stateless

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Error bodies of the routes, for the OpenAPI description of the wire contract.
ERRORS = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        401: "missing or wrong access token",
        404: "unknown, closed or expired session",
        413: "code longer than max_code_chars",
        429: "overloaded; retry after Retry-After seconds",
        503: "no call slot, kernel or session in time; the code did not run: retry after Retry-After seconds",
    }.items()
}


@dataclass(frozen=True)
class ServerSettings:
    """The service: address, access, admission and session policy, and the kernel pool."""

    host: str = "127.0.0.1"
    """Address to bind. Any address other than loopback requires a token."""
    port: int = 8765
    token: str = ""
    """Access token clients send as `Authorization: Bearer ...`; empty = no check (loopback only)."""
    max_code_chars: int = 100_000
    """Longer code is refused with 413."""
    max_sessions: int = 256
    """Open stateful sessions at once; beyond it, creating one gets 503."""
    session_idle_s: float = 600.0
    """A session unused this long is closed; its id then gets 404."""
    max_running: int = 8
    """Calls executing at once (stateful and stateless together)."""
    max_waiting: int = 64
    """Calls waiting for a slot; beyond it a call gets 429 with Retry-After."""
    run_code_output_limit_bytes: int = sandboxfusion.OUTPUT_LIMIT_BYTES
    """POST /run_code keeps the first this many bytes of each of stdout and stderr (SandboxFusion's 1 MiB)."""
    require_isolation: bool = False
    """Refuse to start unless namespaces isolation (no network, read-only root, own uid) works."""
    drain_s: float = 20.0
    """After SIGTERM the server drains (drain.py): new work is refused, open sessions may go on this long; then the
    ones left are cut and it exits. 0: exit at once, cutting every session."""
    pool: PoolSettings = field(default_factory=PoolSettings)

    def __post_init__(self) -> None:
        if self.host not in LOOPBACK and not self.token:
            raise ValueError(
                f"binding {self.host!r} (not loopback) needs an access token: pass --token or set SANDBOX_TOKEN"
            )
        if self.max_running < 1 or self.max_waiting < 0 or self.max_sessions < 0:
            raise ValueError("max_running must be >= 1, max_waiting and max_sessions >= 0")
        if self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0; got {self.drain_s}")
        if self.run_code_output_limit_bytes < 100:
            raise ValueError(f"run_code_output_limit_bytes must be >= 100; got {self.run_code_output_limit_bytes}")


KERNEL_OPEN_FILES = 16
"""File descriptors the server holds per kernel: zmq sockets and their context, pipes (measured: 15.5)."""
SERVER_OPEN_FILES = 64
"""Those of the server itself: listening socket, event loop, standard streams, the uid range lock, and spare."""


def open_files_needed(settings: ServerSettings) -> int:
    """File descriptors the server may need at once: its kernels', one per connection (a session's client, a call
    running or waiting), and its own. A session holds a kernel, so there are no more of them than kernels."""
    connections = min(settings.max_sessions, settings.pool.max_kernels) + settings.max_running + settings.max_waiting
    return settings.pool.max_kernels * KERNEL_OPEN_FILES + connections + SERVER_OPEN_FILES


def raise_open_files_limit(needed: int) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (as the Go runtime does at start): the soft limit
    is often 1024, which 64 kernels use up. Returns (soft limit before, now); ValueError when `needed` does not fit
    under the hard limit, saying what to change."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(before, needed)
    soft = before
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. a hard limit above what the kernel allows (nr_open)
            pass
    if soft < needed:
        raise ValueError(
            f"the server may need {needed} open files ({KERNEL_OPEN_FILES} per kernel for max_kernels, one per "
            f"connection of a session or a call running or waiting, {SERVER_OPEN_FILES} of its own), but its "
            f"limit is {soft} (RLIMIT_NOFILE; hard limit {hard}): raise the hard limit (ulimit -Hn, systemd "
            "LimitNOFILE=, docker --ulimit nofile=) or lower --max-kernels"
        )
    return before, soft


class Overloaded(Exception):
    pass


class NoSlot(Exception):
    pass


class Admission:
    """A bounded queue in front of the kernels: run, wait a bounded time, or be refused at once."""

    def __init__(self, max_running: int, max_waiting: int):
        self.max_waiting = max_waiting
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def slot(self, wait_s: float) -> AsyncIterator[None]:
        """Overloaded at once when max_waiting calls wait already; NoSlot when none is free within wait_s."""
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise Overloaded
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise NoSlot from None
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()


class Metrics:
    """The service's Prometheus metrics; the kernel pool's own counts are read from it at each scrape."""

    def __init__(self, pool: KernelPool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        self.runs = Counter("sandbox_runs", "Code runs by kind and status", ["kind", "status"], registry=self.registry)
        self.duration = Histogram(
            "sandbox_run_seconds", "Run time of a call, queueing excluded", ["kind"], registry=self.registry
        )
        self.rejected = Counter("sandbox_rejected", "Calls refused because of overload", registry=self.registry)
        self.drain_refused = Counter(
            "sandbox_drain_refused", "New sessions and stateless calls refused while draining", registry=self.registry
        )
        self.gauges = {
            name: Gauge(f"sandbox_{name}", help_text, registry=self.registry)
            for name, help_text in {
                "sessions": "Open stateful sessions",
                "pool_ready": "Warm kernels ready",
                "kernels_alive": "Kernel processes alive",
                "running": "Calls running",
                "waiting": "Calls waiting for a slot",
                "capacity_sessions": "Most stateful sessions open at once (max_sessions)",
                "capacity_kernels": "Most kernels alive at once, sessions' and the pool's (max_kernels)",
                "ready": "1 when the server can take a new session now (readiness), else 0",
                "draining": "1 while the server drains after SIGTERM, else 0",
            }.items()
        }
        self.registry.register(self)  # collect() below

    def collect(self) -> Iterator[Metric]:
        """The pool's counts as they are now: kernel starts, failed starts and retirements by cause, waits for a
        kernel."""
        pool = self.pool
        yield CounterMetricFamily("sandbox_kernel_starts", "Kernels started and warmed up", value=pool.kernels_started)
        failures = CounterMetricFamily(
            "sandbox_kernel_start_failures", "Kernel starts that failed, by cause", labels=["cause"]
        )
        for cause in KernelPool.FAILURE_CAUSES:
            failures.add_metric([cause], pool.start_failures_by_cause[cause])
        yield failures
        retired = CounterMetricFamily(
            "sandbox_kernel_retirements", "Kernels stopped while the pool runs, by cause", labels=["cause"]
        )
        for cause in KernelPool.RETIRE_CAUSES:
            retired.add_metric([cause], pool.retired_by_cause[cause])
        yield retired
        yield GaugeMetricFamily(
            "sandbox_kernels_starting", "Kernels being started (at most max_starting)", value=pool.starting_count
        )
        yield GaugeMetricFamily("sandbox_kernel_waiting", "Calls waiting for a ready kernel", value=pool.waiting_count)
        edges = [f"{edge:g}" for edge in KernelPool.WAIT_BUCKETS_S] + ["+Inf"]
        yield HistogramMetricFamily(
            "sandbox_kernel_wait_seconds",
            "How long a call waited for a ready kernel (0 when one was ready)",
            buckets=list(zip(edges, itertools.accumulate(pool.wait_counts), strict=True)),
            sum_value=pool.wait_sum_s,
        )
        yield CounterMetricFamily(
            "sandbox_kernel_waits_refused",
            "Calls that got no kernel within queue_wait_s (HTTP 503 for a stateless call)",
            value=pool.waits_refused,
        )
        yield CounterMetricFamily(
            "sandbox_calls_rerun",
            "Stateless calls run once more because they failed before any of their code started",
            value=pool.calls_rerun,
        )


def create_app(settings: ServerSettings) -> FastAPI:
    pool = KernelPool(settings.pool)
    sessions = SessionStore(pool, settings.max_sessions, settings.session_idle_s)
    admission = Admission(settings.max_running, settings.max_waiting)
    metrics = Metrics(pool)
    drain = Drain(settings.drain_s)
    # What the server holds at once, for a trainer to check a step against before it starts (each stateful episode
    # holds a session, and a session a kernel): the same numbers on /healthz and /metrics.
    capacity = {"sessions": settings.max_sessions, "kernels": settings.pool.max_kernels}

    async def expire_loop() -> None:
        while True:
            await asyncio.sleep(min(30.0, settings.session_idle_s / 4))
            await sessions.expire()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        if settings.require_isolation and pool.isolation.mode != "namespaces":
            await pool.close()
            raise RuntimeError(f"--require-isolation: only {pool.isolation.mode} isolation is available here")
        expiry = asyncio.create_task(expire_loop())
        try:
            yield
        finally:
            expiry.cancel()
            await sessions.close_all()
            await pool.close()

    app = FastAPI(title="stare-agent sandbox", version="1", lifespan=lifespan)
    app.state.pool, app.state.sessions, app.state.admission = pool, sessions, admission

    async def run_drain() -> list[str]:
        """Drain this server (drain.py); returns the ids of the sessions cut at the deadline."""
        return await drain.run(sessions, lambda: admission.running + admission.waiting)

    app.state.run_drain = run_drain

    def not_ready_because() -> list[str]:
        """Why a new session would not be taken now; empty: ready."""
        why = []
        if drain.draining:
            why.append("draining")
        if len(sessions) + sessions.opening >= settings.max_sessions:
            why.append(f"the session limit ({settings.max_sessions}) is reached")
        if not pool.ready_count and pool.alive_count >= settings.pool.max_kernels:
            why.append(f"no kernel ready and max_kernels ({settings.pool.max_kernels}) alive")
        return why

    def refuse_new_work() -> None:
        """503 with Retry-After and the DRAINING_HEADER for new work while draining: the client takes it elsewhere.
        Retry-After stays short (not the drain's deadline): a client with one server waits that long per try."""
        if drain.draining:
            metrics.drain_refused.inc()
            raise HTTPException(
                503,
                "the server is draining (shutting down): it takes no new sessions or stateless calls; "
                "send them to another server",
                headers={"Retry-After": "1", DRAINING_HEADER: "1"},
            )

    def token_accepted(request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return not settings.token or hmac.compare_digest(given.encode(), f"Bearer {settings.token}".encode())

    @app.middleware("http")
    async def check_token(request: Request, call_next):  # noqa: ANN202 - FastAPI middleware signature
        if request.url.path not in ("/healthz", "/readyz") and not token_accepted(request):
            return JSONResponse({"detail": "missing or wrong access token"}, status_code=401)
        response = await call_next(request)
        if drain.draining:
            # no idle connection is left for the exit to close under a request the client just sent on it
            response.headers["Connection"] = "close"
        return response

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        metrics.rejected.inc()
        return JSONResponse(
            {"detail": f"overloaded: {admission.running} running, {admission.waiting} waiting; retry later"},
            status_code=429,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(NoSlot)
    async def no_slot(request: Request, exc: NoSlot) -> JSONResponse:
        metrics.rejected.inc()
        detail = (
            f"no call slot became free within queue_wait_s={settings.pool.queue_wait_s:g}s ({admission.running} "
            f"running, {admission.waiting} waiting); the code did not run, retry later"
        )
        return JSONResponse({"detail": detail}, status_code=503, headers={"Retry-After": "1"})

    def timeout_of(body: ExecuteRequest) -> tuple[float, bool]:
        if len(body.code) > settings.max_code_chars:
            raise HTTPException(413, f"code has {len(body.code)} characters; the limit is {settings.max_code_chars}")
        return call_timeout(settings.pool, body.timeout_s)

    async def run(kind: str, call, timeout: tuple[float, bool]) -> RunResult:  # noqa: ANN001 - a coroutine factory
        """`call(wait_s)` in a call slot. Its waits, for the slot and then for a kernel, end queue_wait_s after it
        came, in a 503 (its code never ran): so it is answered before the client's HTTP timeout, which can only
        take it for lost (a session's state with it), however long the calls ahead run or kernels take to start."""
        deadline = time.monotonic() + settings.pool.queue_wait_s
        async with admission.slot(settings.pool.queue_wait_s):
            started = time.perf_counter()
            try:
                result = await call(deadline - time.monotonic())
            except SandboxError as exc:
                if isinstance(exc, KernelsBusy):
                    # the call got no kernel in time (stateless, or a session whose kernel died), so its code
                    # never ran: 503 with Retry-After tells the client to back off and send it again
                    raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None
                result = RunResult(
                    status="sandbox_error",
                    error={"name": "SandboxError", "message": str(exc)},
                    duration_ms=(time.perf_counter() - started) * 1000,
                )
        metrics.runs.labels(kind, result.status).inc()
        metrics.duration.labels(kind).observe(result.duration_ms / 1000)
        return result.model_copy(update={"timeout_s": timeout[0], "timeout_capped": timeout[1]})

    def unknown(session_id: str) -> HTTPException:
        return HTTPException(404, f"no session {session_id!r}: it was closed, expired, or never existed")

    @app.post("/v1/sessions", status_code=201, response_model=SessionCreated, responses=ERRORS)
    async def create_session() -> SessionCreated:
        refuse_new_work()
        # No call slot: it runs no code, only waits (up to queue_wait_s) for a kernel, and max_sessions bounds how
        # many do. Holding slots, a burst of new sessions left the calls of open sessions queued behind it.
        try:
            return SessionCreated(session_id=await sessions.create())
        except SandboxError as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None

    @app.post("/v1/sessions/{session_id}/execute", response_model=RunResult, responses=ERRORS)
    async def execute_in_session(session_id: str, body: ExecuteRequest) -> RunResult:
        timeout = timeout_of(body)
        if drain.deadline_passed:
            raise HTTPException(404, f"session {session_id!r} was closed: the server is shutting down")
        if not sessions.exists(session_id):
            raise unknown(session_id)

        async def call(wait_s: float) -> RunResult:
            return await sessions.execute(session_id, body.code, timeout[0], wait_s)

        try:
            return await run("session", call, timeout)
        except KeyError:  # closed or expired while waiting for a slot
            raise unknown(session_id) from None

    @app.delete("/v1/sessions/{session_id}", status_code=204, responses=ERRORS)
    async def close_session(session_id: str) -> Response:
        if not await sessions.close(session_id):
            raise unknown(session_id)
        return Response(status_code=204)

    @app.post("/v1/execute", response_model=RunResult, responses=ERRORS)
    async def execute_stateless(body: ExecuteRequest) -> RunResult:
        refuse_new_work()
        timeout = timeout_of(body)
        return await run("stateless", lambda wait_s: run_stateless(pool, body.code, timeout[0], wait_s), timeout)

    # SandboxFusion's API (sandboxfusion.py), for stacks that call it, e.g. verl's ReTool recipe
    @app.post("/run_code", response_model=RunCodeResponse, responses={k: v for k, v in ERRORS.items() if k != 404})
    async def run_code(body: RunCodeRequest) -> RunCodeResponse:
        refuse_new_work()
        timeout = timeout_of(ExecuteRequest(code=body.code, timeout_s=body.run_timeout))
        files_chars = sum(len(content or "") for content in body.files.values())
        if files_chars > settings.max_code_chars:
            raise HTTPException(
                413, f"files have {files_chars} base64 characters; the limit is {settings.max_code_chars}"
            )
        code = sandboxfusion.program(body)
        limit = settings.run_code_output_limit_bytes
        result = await run("run_code", lambda wait_s: run_stateless(pool, code, timeout[0], wait_s, limit), timeout)
        return sandboxfusion.response(result)

    @app.get("/healthz")
    async def healthz(request: Request) -> dict:
        why = not_ready_because()
        return {
            "status": "draining" if drain.draining else "ok",
            "live": True,
            "ready": not why,
            "not_ready_because": why,
            "draining": drain.draining,
            "drain_left_s": drain.left_s(),
            "token_accepted": token_accepted(request),
            "isolation": pool.isolation.as_dict() if pool.isolation else None,
            "caps": pool.caps(),
            "capacity": capacity,
            "sessions": len(sessions),
            "pool_ready": pool.ready_count,
            "kernels_alive": pool.alive_count,
            "running": admission.running,
            "waiting": admission.waiting,
            "kernel_start_failures": pool.start_failures,
            "kernel_start_failures_by_cause": {c: pool.start_failures_by_cause[c] for c in KernelPool.FAILURE_CAUSES},
            "kernels_started": pool.kernels_started,
            "kernels_retired_by_cause": {c: pool.retired_by_cause[c] for c in KernelPool.RETIRE_CAUSES},
            "kernels_starting": pool.starting_count,
            "kernels_starting_peak": pool.starting_peak,
            "max_starting": settings.pool.max_starting,
            "kernel_waiting": pool.waiting_count,
            "kernel_waits_refused": pool.waits_refused,
            "calls_rerun": pool.calls_rerun,
            "open_files": {
                "open": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None,
                "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                "needed": open_files_needed(settings),
            },
        }

    @app.get("/readyz", responses={503: {"description": "not ready: draining, or no session or kernel free"}})
    async def readyz() -> JSONResponse:
        """Readiness for a scheduler's probe: 200 when a new session would be taken now, else 503 saying why."""
        why = not_ready_because()
        return JSONResponse({"ready": not why, "not_ready_because": why}, status_code=503 if why else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        values = {
            "ready": int(not not_ready_because()),
            "draining": int(drain.draining),
            "sessions": len(sessions),
            "pool_ready": pool.ready_count,
            "kernels_alive": pool.alive_count,
            "running": admission.running,
            "waiting": admission.waiting,
            **{f"capacity_{name}": value for name, value in capacity.items()},
        }
        for name, value in values.items():
            metrics.gauges[name].set(value)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
