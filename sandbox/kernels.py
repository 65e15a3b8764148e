"""Jupyter kernels for model-written code: a warm pool, stateful sessions and stateless runs.

Every kernel runs in its own scratch directory, under the isolation of `sandbox.isolation`, with
numpy and sympy imported before it is handed out. A stateful session keeps one kernel (variables
persist across calls). A stateless run takes a pooled kernel, runs the code, then wipes the
kernel's namespace and scratch directory (`%reset`) before the kernel serves another run; a kernel
is replaced after `stateless_reuse` runs or after anything unusual (timeout, death). Reset clears the
user namespace, not the interpreter: modules stay imported, so a run that patches a module can
affect later runs on the same kernel until it is replaced. Set `stateless_reuse = 0` for a fresh
process every run (slower: one kernel start per call).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager

from sandbox.isolation import (
    UID_BASE,
    Isolation,
    IsolationMode,
    Limits,
    detect_isolation,
    kernel_argv,
    kernel_env,
    make_scratch,
    remove_scratch,
)
from sandbox.schemas import ErrorInfo, RunResult

log = logging.getLogger("sandbox")
T = TypeVar("T")

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Runs after a stateless call: forget the user's names, empty the scratch dir, restore cwd (warm-up follows).
# Not %reset: it runs a full gc.collect, ~70 ms with numpy and sympy loaded.
RESET_CODE = """\
def _sandbox_reset():
    import os
    import shutil

    shell = get_ipython()
    for name in [n for n in shell.user_ns if n not in shell.user_ns_hidden]:
        del shell.user_ns[name]
    os.chdir(os.environ["HOME"])
    for name in os.listdir("."):
        if name.startswith(("ipc-", "kernel.json", ".ipython")):
            continue
        if os.path.isdir(name) and not os.path.islink(name):
            shutil.rmtree(name, ignore_errors=True)
        else:
            os.remove(name)


_sandbox_reset()
"""


@dataclass(frozen=True)
class PoolSettings:
    """How kernels are started, limited and reused."""

    pool_size: int = 4
    """Warm kernels kept ready (numpy and sympy imported)."""
    max_kernels: int = 64
    """Kernels alive at once: sessions plus the pool. Also the number of distinct kernel uids."""
    isolation: IsolationMode = "auto"
    """auto: namespaces where they work, else process isolation; namespaces: require them."""
    limits: Limits = field(default_factory=Limits)
    """Per-kernel resource limits."""
    default_timeout_s: float = 10.0
    """Wall-clock limit of a call that names none."""
    max_timeout_s: float = 120.0
    """Upper bound on a call's timeout_s."""
    interrupt_grace_s: float = 2.0
    """After a timeout, how long an interrupted kernel may take to stop before it is killed and replaced."""
    output_limit_chars: int = 20_000
    """stdout and stderr are each cut to this many characters (head + marker + tail)."""
    startup_timeout_s: float = 60.0
    """A kernel that is not ready within this is a sandbox_error."""
    stateless_reuse: int = 50
    """Stateless runs a kernel serves (reset between them) before it is replaced, drawn per kernel from
    [ceil(n/2), n] so kernels do not all retire together; 0 = a fresh kernel every run."""
    scratch_root: str = ""
    """Where scratch directories are made; empty = a new folder in the system temp dir."""
    warmup_code: str = "import math\nimport numpy as np\nimport sympy as sp\n"
    """Run in every new kernel before it is handed out."""

    def __post_init__(self) -> None:
        if not 0 <= self.pool_size <= self.max_kernels:
            raise ValueError(f"pool_size must be in [0, max_kernels={self.max_kernels}]; got {self.pool_size}")
        if not 0 < self.default_timeout_s <= self.max_timeout_s:
            raise ValueError(
                f"default_timeout_s must be in (0, max_timeout_s={self.max_timeout_s}]; got {self.default_timeout_s}"
            )
        if self.output_limit_chars < 100:
            raise ValueError(f"output_limit_chars must be >= 100; got {self.output_limit_chars}")
        if self.stateless_reuse < 0 or self.interrupt_grace_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("stateless_reuse must be >= 0, interrupt_grace_s and startup_timeout_s > 0")


class SandboxError(RuntimeError):
    """The service could not run the code (as opposed to the code failing)."""


class _NoFreeSlot(SandboxError):
    """Every kernel slot is taken (acquire then waits for a kernel to come back)."""


class _Capture:
    """Keeps the first and last `limit // 2` characters of a stream, so huge output costs bounded memory."""

    def __init__(self, limit: int):
        self.half = limit // 2
        self.head: list[str] = []
        self.head_len = 0
        self.tail = ""
        self.total = 0

    def add(self, text: str) -> None:
        self.total += len(text)
        if self.head_len < self.half:
            take = text[: self.half - self.head_len]
            self.head.append(take)
            self.head_len += len(take)
            text = text[len(take) :]
        if text:
            self.tail = (self.tail + text)[-self.half :]

    @property
    def truncated(self) -> bool:
        return self.total > 2 * self.half

    def text(self) -> str:
        head = "".join(self.head)
        if not self.truncated:
            return head + self.tail[: self.total - self.head_len]
        cut = self.total - len(head) - len(self.tail)
        return f"{head}\n... [{cut} characters cut] ...\n{self.tail}"


class _SandboxKernelManager(AsyncKernelManager):
    """Starts the kernel with this kernel's own argv (its uid differs per kernel) instead of the spec's."""

    sandbox_argv: list[str] = []

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return [arg.replace("{connection_file}", self.connection_file) for arg in self.sandbox_argv]


class Kernel:
    """One kernel process, its client and its scratch directory."""

    def __init__(self, manager: AsyncKernelManager, scratch: Path, slot: int):
        self.manager = manager
        self.client = manager.client(context=manager.context)
        self.scratch = scratch
        self.slot = slot
        self.runs = 0  # stateless runs served, resets and warm-up not counted
        self.reuse_limit = 0  # stateless runs before replacement; set by the pool
        self.dead = False
        self.closing = False  # shutdown() was called
        self._stopping = asyncio.Lock()

    async def execute(self, code: str, timeout_s: float, settings: PoolSettings) -> RunResult:
        """Run `code`; never raises for anything the code does."""
        started = time.perf_counter()
        stdout, stderr = _Capture(settings.output_limit_chars), _Capture(settings.output_limit_chars)
        # stop_on_error=False: otherwise ipykernel may answer "aborted" to the call after an error or interrupt.
        msg_id = self.client.execute(code, silent=False, store_history=False, allow_stdin=False, stop_on_error=False)
        error: ErrorInfo | None = None
        status = "ok"
        deadline = time.monotonic() + timeout_s
        interrupted_at: float | None = None
        while True:
            now = time.monotonic()
            if interrupted_at is None and now >= deadline:
                interrupted_at = now
                await self._interrupt()
            if interrupted_at is not None and now >= interrupted_at + settings.interrupt_grace_s:
                self.dead = True  # stuck (e.g. in C code): the caller replaces the kernel
                status, error = (
                    "timeout",
                    ErrorInfo(
                        name="Timeout",
                        message=f"no result within {timeout_s:g}s; the kernel did not stop when interrupted and was "
                        "restarted, so all variables are lost",
                    ),
                )
                break
            try:
                msg = await self.client.get_iopub_msg(timeout=0.1)
            except asyncio.CancelledError:
                # shutdown() stopped the channels under this call (the pool is closing): that cancels the poll,
                # but the caller asked for no cancellation and gets a result
                if not self.closing or _cancel_requested():
                    raise
                self.dead = True
                message = "the sandbox shut down while this code ran; its kernel was stopped"
                elapsed = (time.perf_counter() - started) * 1000
                return RunResult(
                    status="sandbox_error", error=ErrorInfo(name="SandboxClosed", message=message), duration_ms=elapsed
                )
            except queue.Empty:
                if not await self.manager.is_alive():
                    self.dead = True
                    status, error = (
                        "sandbox_error",
                        ErrorInfo(
                            name="KernelDied",
                            message="the kernel process exited while running this code (e.g. a crash or os._exit); "
                            "all variables are lost and the next call runs on a fresh kernel",
                        ),
                    )
                    break
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (stdout if content.get("name") == "stdout" else stderr).add(content.get("text", ""))
            elif kind in ("execute_result", "display_data"):
                text = content.get("data", {}).get("text/plain")
                if text is not None and kind == "execute_result":
                    stdout.add(text + "\n")
            elif kind == "error":
                name = content.get("ename", "Error")
                traceback = ANSI.sub("", "\n".join(content.get("traceback", [])))
                error = ErrorInfo(name=name, message=content.get("evalue", ""), traceback=traceback)
                if interrupted_at is not None and name == "KeyboardInterrupt":
                    status = "timeout"
                    error = ErrorInfo(
                        name="Timeout",
                        message=f"no result within {timeout_s:g}s; interrupted (variables are kept)",
                        traceback=traceback,
                    )
                elif "MemoryError" in name:
                    status = "memory"
                else:
                    status = "error"
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        await self._drain_shell()
        return RunResult(
            status=status,
            stdout=stdout.text(),
            stderr=stderr.text(),
            error=error,
            truncated=stdout.truncated or stderr.truncated,
            duration_ms=(time.perf_counter() - started) * 1000,
        )

    async def _drain_shell(self) -> None:
        """Read the execute replies we do not need (iopub carries everything), so they do not pile up."""
        with contextlib.suppress(Exception):
            while True:
                await self.client.get_shell_msg(timeout=0)

    async def _interrupt(self) -> None:
        with contextlib.suppress(Exception):
            await self.manager.interrupt_kernel()

    async def shutdown(self) -> None:
        """Kill the kernel's processes and remove its scratch dir. Calls wait for one another, and a later call
        does the work again: a kernel whose start was still launching it at the first call is killed by the next.
        """
        self.closing = True
        async with self._stopping:
            with contextlib.suppress(Exception):
                self.client.stop_channels()
            heartbeat = getattr(self.client, "_hb_channel", None)  # a thread: must not outlive the context below
            if heartbeat is not None and heartbeat.is_alive():  # stop_channels failed before reaching it
                with contextlib.suppress(Exception):
                    heartbeat.stop()
            if self.manager.has_kernel:
                with contextlib.suppress(Exception):
                    await self.manager.shutdown_kernel(now=True)
            remove_scratch(self.scratch)
            # Frees the kernel's sockets, in this (the event loop's) thread: its asyncio sockets are registered
            # with this loop, and destroying the context from another thread left ~1000 file descriptors open
            # (measured) until zmq ran out of sockets. The heartbeat thread was stopped above.
            with contextlib.suppress(Exception):
                self.manager.context.destroy(linger=0)

    def kill_now(self) -> None:
        """`shutdown` without an event loop: SIGKILL the kernel's process group, reap it, remove the scratch dir."""
        process = getattr(self.manager.provisioner, "process", None)  # jupyter_client's LocalProvisioner: a Popen
        if process is not None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # its own group: jupyter_client starts it in a new session
            with contextlib.suppress(Exception):
                process.wait(timeout=5)
        remove_scratch(self.scratch)


class KernelPool:
    """Starts kernels ahead of demand and hands them out; knows nothing about HTTP."""

    def __init__(self, settings: PoolSettings):
        self.settings = settings
        self.isolation: Isolation | None = None
        self._ready: asyncio.Queue[Kernel] = asyncio.Queue()
        self._free_slots = list(range(settings.max_kernels))
        self._slot_freed = asyncio.Condition()
        self._background: set[asyncio.Task] = set()
        self._refilling = False
        self._resetting = 0  # stateless kernels being reset in the background
        self._closed = False
        # Every kernel whose process may exist: starting, ready, in use (session or stateless run) or resetting.
        self._kernels: set[Kernel] = set()
        self._owns_root = not settings.scratch_root
        self._root: Path | None = Path(settings.scratch_root) if settings.scratch_root else None
        self._specs: KernelSpecManager | None = None
        self.kernels_started = 0
        self.start_failures = 0

    async def start(self) -> None:
        """Probe the isolation, make the scratch root and start filling the pool; on failure (or cancellation)
        everything made so far is removed again."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        self.isolation = await asyncio.to_thread(detect_isolation, self.settings.isolation)
        if self._root is None:  # made here, not in __init__: a pool never started leaves nothing on disk
            self._root = Path(tempfile.mkdtemp(prefix="sandbox-"))
        self._root.mkdir(parents=True, exist_ok=True)
        atexit.register(self._remove_leftovers)
        self._root.chmod(0o711)  # kernels running as other uids must reach their own scratch dirs
        spec_dir = self._root / "kernelspec" / "sandbox"
        spec_dir.mkdir(parents=True, exist_ok=True)
        # The spec names the kernel for jupyter_client; each kernel's real argv (its own uid) is set per kernel.
        spec = {
            "argv": kernel_argv(self.isolation, self.settings.limits, UID_BASE),
            "display_name": "sandbox",
            "language": "python",
            "interrupt_mode": "signal",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        self._specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
        self._refill()

    @property
    def ready_count(self) -> int:
        return self._ready.qsize()

    @property
    def alive_count(self) -> int:
        return self.settings.max_kernels - len(self._free_slots)

    async def acquire(self) -> Kernel:
        """A warm kernel: from the pool if one is ready (or about to be, after a reset), else started now.

        When every kernel already exists (more concurrent calls than max_kernels), wait for one to be given
        back or for a slot to free up, up to startup_timeout_s: a burst of calls queues instead of failing.
        """
        if self._closed:
            raise SandboxError("the kernel pool is closed (the sandbox is shutting down)")
        self._refill()
        deadline = time.monotonic() + self.settings.startup_timeout_s
        waited = False  # a reset takes milliseconds, a kernel start half a second: wait for a reset once
        while True:
            try:
                kernel = self._ready.get_nowait()
                break
            except asyncio.QueueEmpty:
                pass
            if self._free_slots and (not self._resetting or waited):
                try:
                    kernel = await self._start_kernel()
                    break
                except _NoFreeSlot:
                    pass  # another caller took the last slot first
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError(
                    f"all {self.settings.max_kernels} kernels stayed busy for {self.settings.startup_timeout_s:g}s"
                )
            try:
                kernel = await _wait_for(self._ready.get(), min(1.0, remaining), self._ready.put_nowait)
                break
            except asyncio.TimeoutError:
                waited = True
        self._refill()
        return kernel

    def give_back_later(self, kernel: Kernel) -> None:
        """give_back in the background, so the caller's result is not delayed by the reset."""
        self._resetting += 1
        task = asyncio.get_running_loop().create_task(self.give_back(kernel))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def give_back(self, kernel: Kernel) -> None:
        """After a stateless run: reset and pool the kernel, or replace it."""
        try:
            reusable = not kernel.dead and kernel.runs < kernel.reuse_limit and not self._closed
            if reusable:
                reset = await kernel.execute(RESET_CODE + self.settings.warmup_code, 30.0, self.settings)
                reusable = reset.status == "ok" and not kernel.dead and not self._closed
            if reusable:
                await self._ready.put(kernel)
            else:
                await self.discard(kernel)
        except BaseException:
            await _run_to_end(self.discard(kernel))
            raise
        finally:
            self._resetting = max(0, self._resetting - 1)

    async def discard(self, kernel: Kernel) -> None:
        await self._stop(kernel)
        async with self._slot_freed:
            self._free_slots.append(kernel.slot)
            self._slot_freed.notify()
        self._refill()

    async def close(self) -> None:
        """Kill every kernel of the pool and remove every scratch dir, whatever the kernels are doing.

        Also kernels that are starting, resetting, or held by a session or a stateless run whose caller will never
        give them back: asyncio.run, interrupted (Ctrl-C, or SIGTERM turned into an exception by the CLI), cancels
        every task at once, those callers too. Goes on to the end when the calling task is cancelled meanwhile.
        """
        self._closed = True
        await _run_to_end(self._close())

    async def _close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(self._stop(kernel) for kernel in list(self._kernels)), return_exceptions=True)
        while not self._ready.empty():
            self._ready.get_nowait()
        if self._owns_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        atexit.unregister(self._remove_leftovers)

    def _remove_leftovers(self) -> None:
        """At interpreter exit, if close() has not finished: kill the kernels, remove the scratch dirs, no loop needed.

        close() cannot finish when the event loop is closed under it. That happens when a KeyboardInterrupt (or the
        CLI's SIGTERM/SIGHUP exception) is raised inside a task: asyncio stores it in the task and raises it out of
        the loop again from every task that awaits it, also while asyncio.run is cancelling tasks at the end, and
        then closes the loop with close() half done. The kernels would die with this process anyway (isolation:
        parent-death signal); their scratch dirs would not.
        """
        for kernel in list(self._kernels):
            kernel.kill_now()
        if self._owns_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    async def _stop(self, kernel: Kernel) -> None:
        await kernel.shutdown()
        self._kernels.discard(kernel)

    def _refill(self) -> None:
        if self._closed or self._refilling or self._ready.qsize() >= self.settings.pool_size:
            return
        self._refilling = True
        task = asyncio.get_running_loop().create_task(self._refill_loop())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refill_loop(self) -> None:
        try:
            while not self._closed and self._ready.qsize() < self.settings.pool_size and self._free_slots:
                try:
                    kernel = await self._start_kernel()
                except SandboxError as exc:
                    log.warning("could not start a pool kernel: %s", exc)
                    await asyncio.sleep(1.0)
                    continue
                await self._ready.put(kernel)
        finally:
            self._refilling = False

    async def _start_kernel(self) -> Kernel:
        assert self._specs is not None and self.isolation is not None, "KernelPool.start() was not awaited"
        if self._closed:
            raise SandboxError("the kernel pool is closed (the sandbox is shutting down)")
        async with self._slot_freed:
            if not self._free_slots:
                raise _NoFreeSlot(f"all {self.settings.max_kernels} kernels are in use")
            slot = self._free_slots.pop(0)
        uid = UID_BASE + slot if self.isolation.unprivileged_user else None
        scratch = make_scratch(self._root, uid)
        # The kernel's own zmq context, shared by its manager and client and destroyed by Kernel.shutdown once both
        # are stopped, with linger 0 (jupyter_client's own contexts are destroyed with linger 100, once per
        # client and manager, and that once blocked for good for a client stopped mid-start).
        manager = _SandboxKernelManager(
            kernel_name="sandbox", kernel_spec_manager=self._specs, context=zmq.asyncio.Context()
        )
        manager.sandbox_argv = kernel_argv(self.isolation, self.settings.limits, uid)
        manager.transport = "ipc"
        manager.ip = str(scratch / "ipc")
        manager.connection_file = str(scratch / "kernel.json")
        kernel = Kernel(manager, scratch, slot)
        self._kernels.add(kernel)
        # Spread retirements: with one shared limit, kernels used in turn all retire in the same second and
        # every waiting call starts a kernel (docs/sandbox.md, stateless at concurrency 32).
        reuse = self.settings.stateless_reuse
        kernel.reuse_limit = random.randint((reuse + 1) // 2, reuse) if reuse else 0
        try:
            await _wait_for(manager.start_kernel(env=kernel_env(scratch)), self.settings.startup_timeout_s)
            kernel.client = manager.client(context=manager.context)
            # No heartbeat thread: liveness comes from the manager (the client's parent), and jupyter_client's
            # HBChannel, stopped before its thread has set `_running`, spins creating REQ sockets until zmq
            # runs out of them ("Too many open files"), which a kernel stopped right after its start hit.
            kernel.client.start_channels(hb=False)
            await kernel.client.wait_for_ready(timeout=self.settings.startup_timeout_s)
            warm = await kernel.execute(self.settings.warmup_code, self.settings.startup_timeout_s, self.settings)
            if warm.status != "ok":
                raise SandboxError(f"warm-up failed: {warm.error.message if warm.error else warm.status}")
            if self._closed:  # close() ran while this kernel started and may have found no process yet
                raise SandboxError("the kernel pool was closed while this kernel started")
        except BaseException as exc:  # including cancellation at shutdown: never leave a process behind
            self.start_failures += not isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
            await _run_to_end(self._stop(kernel))
            async with self._slot_freed:
                self._free_slots.append(slot)
            if isinstance(exc, (SandboxError, asyncio.CancelledError)) or not isinstance(exc, Exception):
                raise
            raise SandboxError(f"kernel did not start: {type(exc).__name__}: {exc}") from exc
        self.kernels_started += 1
        return kernel


@dataclass
class Session:
    kernel: Kernel
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionStore:
    """Stateful sessions: one kernel each, closed on request, on expiry and at shutdown."""

    def __init__(self, pool: KernelPool, max_sessions: int, idle_s: float):
        self.pool = pool
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    async def create(self) -> str:
        if len(self._sessions) >= self.max_sessions:
            raise SandboxError(f"the session limit ({self.max_sessions}) is reached")
        kernel = await self.pool.acquire()
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = Session(kernel, time.monotonic())
        return session_id

    def exists(self, session_id: str) -> bool:
        return session_id in self._sessions

    async def execute(self, session_id: str, code: str, timeout_s: float) -> RunResult:
        session = self._sessions[session_id]
        async with session.lock:
            session.last_used = time.monotonic()
            result = await session.kernel.execute(code, timeout_s, self.pool.settings)
            if session.kernel.dead:  # the next call runs on a fresh kernel
                old, session.kernel = session.kernel, await self.pool.acquire()
                await self.pool.discard(old)
            session.last_used = time.monotonic()
            return result

    async def close(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        async with session.lock:
            await self.pool.discard(session.kernel)
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


async def run_stateless(pool: KernelPool, code: str, timeout_s: float) -> RunResult:
    kernel = await pool.acquire()
    kernel.runs += 1
    try:
        return await kernel.execute(code, timeout_s, pool.settings)
    except BaseException:
        kernel.dead = True  # cancelled mid-run, the code may still be running: replace the kernel, do not reset it
        raise
    finally:
        pool.give_back_later(kernel)


def _cancel_requested() -> bool:
    """Whether the current task is being cancelled (Python 3.11 tells; before, assume it is)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


async def _wait_for(work: Awaitable[T], timeout: float, undo: Callable[[T], object] | None = None) -> T:
    """`asyncio.wait_for` that never loses the caller's cancellation.

    On Python 3.11, when `work` finishes in the same loop turn as the caller is cancelled, `wait_for` returns its
    result and drops the cancellation: a Ctrl-C or SIGTERM that arrived as a kernel became ready then went
    unnoticed and the command ran to its end. Here the cancellation is raised after all, once `undo(result)`
    has put back what `work` took (e.g. a kernel taken from the ready queue).
    """
    result = await asyncio.wait_for(work, timeout)
    cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+; 3.10 cannot tell
    if cancelling is not None and cancelling() > 0:
        if undo is not None:
            undo(result)
        raise asyncio.CancelledError
    return result


async def _run_to_end(work: Awaitable[T]) -> T:
    """Await `work` to its end even if the caller is cancelled meanwhile, then pass the cancellation on.

    For clean-up: `asyncio.shield` stops waiting at the caller's first cancellation, and asyncio.run, once its
    main task is done, closes the loop with the shielded work pending -- kernels alive, scratch dirs left.
    """
    task = asyncio.ensure_future(work)
    interrupted = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError
    return task.result()
