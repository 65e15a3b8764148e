"""One Jupyter kernel for model-written code: its process, its client, its scratch dir, and a call on it.

A call runs under its wall-clock timeout and the per-call caps (`_CallCaps`: CPU seconds, the kernel's memory,
the scratch quota). A kernel that goes over one, dies, or does not stop when interrupted is marked dead, and its
pool (pool.py) replaces it. The fences around the kernel's processes are those of `stare_sandbox.isolation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stare_sandbox.cgroups import Cgroups, range_group
from stare_sandbox.isolation import UID_BASE, UID_RANGE_SIZE, KernelMeter, Limits, remove_scratch
from stare_sandbox.relay import EXIT_ERROR as WORKER_EXIT_ERROR
from stare_sandbox.relay import RELAY_ERROR, TEMPLATE_GONE_EXIT, WORKER_DONE_MIME, WORKER_END_MIME, WORKER_KEY
from stare_sandbox.sandboxfusion import FETCH_MIME, signal_status
from stare_sandbox.schemas import ErrorInfo, RunResult

if TYPE_CHECKING:
    from jupyter_client import AsyncKernelManager

    from stare_sandbox.pool import PoolSettings

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class SandboxError(RuntimeError):
    """The service could not run the code (as opposed to the code failing)."""


class KernelsBusy(SandboxError):
    """No kernel became ready within queue_wait_s: the call never ran, and may be retried later."""


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


class _Head:
    """Keeps the first `limit` bytes of a stream's UTF-8, cut at a character boundary, with no marker: SandboxFusion's
    way (the first 1 MiB of each stream), for /run_code."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept: list[str] = []
        self.size = 0  # bytes kept
        self.truncated = False

    def add(self, text: str) -> None:
        if self.truncated:
            return
        data = text.encode("utf-8", "surrogatepass")
        if self.size + len(data) > self.limit:
            self.truncated = True
            text = data[: self.limit - self.size].decode("utf-8", "ignore")  # a split character is dropped
            data = text.encode("utf-8", "surrogatepass")
        self.kept.append(text)
        self.size += len(data)

    def text(self) -> str:
        return "".join(self.kept)


CAP_CHECK_S = 0.5
"""How often a running call's CPU time, its kernel's OOM kills and scratch size are checked against the caps."""


class _CallCaps:
    """The caps of one call on one kernel (Limits: call_cpu_s, kernel_memory_mb, scratch_mb), measured by KernelMeter.

    A call over a cap gets a result naming it, and its kernel is killed at once and marked dead, so the caller
    replaces it: the kernel's memory, CPU and scratch files (the quota's bytes) are freed with it.
    """

    def __init__(self, kernel: Kernel, meter: KernelMeter, limits: Limits, cpu_cap: float, cpu_start: float):
        self.kernel, self.meter, self.limits = kernel, meter, limits
        self.cpu_cap, self.cpu_start = cpu_cap, cpu_start
        self.oom_start = meter.oom_kills()

    @classmethod
    async def begin(cls, kernel: Kernel, timeout_s: float, limits: Limits) -> _CallCaps:
        process = kernel.process
        first_uid = UID_BASE + kernel.slot - kernel.slot % UID_RANGE_SIZE  # of the pool's range (KernelPool._start)
        meter = KernelMeter(
            kernel.scratch, process.pid if process is not None else None, range_group(first_uid), kernel.cgroups
        )
        # Its processes cannot use more CPU than the wall time times the cores: then the timeout comes first,
        # and the CPU time (a scan of /proc without a cgroup) is never read.
        cpu_cap = limits.call_cpu_s
        if cpu_cap and timeout_s * len(os.sched_getaffinity(0)) <= cpu_cap:
            cpu_cap = 0.0
        cpu_start = await asyncio.to_thread(meter.cpu_seconds) if cpu_cap else 0.0
        return cls(kernel, meter, limits, cpu_cap, cpu_start)

    async def exceeded(self, *, during: bool, scratch_left: int | None = None) -> tuple[str, ErrorInfo] | None:
        """(status, error) if the call went over a cap, after killing the kernel; else None. `scratch_left`: when
        the call's worker has ended (clean_state fork), the bytes it left in the scratch dir, which the template has
        emptied since: then that is what counts, and the dir is not walked."""
        over = self.memory_exceeded()
        if over is None and during and self.cpu_cap:
            used = await asyncio.to_thread(self.meter.cpu_seconds) - self.cpu_start
            if used > self.cpu_cap:
                over = (
                    "timeout",
                    ErrorInfo(
                        name="CPULimit",
                        message=f"the call used more than {self.cpu_cap:g} CPU seconds (all the kernel's processes "
                        "together; limits.call_cpu_s); the kernel was stopped and replaced, so all variables are lost",
                    ),
                )
        if over is None and self.limits.scratch_mb:
            held = await asyncio.to_thread(self.meter.scratch_bytes) if scratch_left is None else scratch_left
            if held > self.limits.scratch_mb * 2**20:
                over = (
                    "error",
                    ErrorInfo(
                        name="ScratchQuota",
                        message=f"the working directory held {held / 2**20:.0f} MiB, over the quota of "
                        f"{self.limits.scratch_mb} MiB (limits.scratch_mb); the kernel was stopped and its files "
                        "removed, so all variables and files are lost",
                    ),
                )
        if over is not None:
            self.kernel.dead = True
            await asyncio.to_thread(self.meter.kill)
        return over

    def memory_exceeded(self) -> tuple[str, ErrorInfo] | None:
        """(status, error) if the kernel's cgroup hit its memory limit during the call (its OOM killer struck)."""
        if self.meter.oom_kills() <= self.oom_start:
            return None
        return "memory", ErrorInfo(
            name="MemoryLimit",
            message=f"the kernel's processes together went over {self.limits.kernel_memory_mb} MiB of memory "
            "(limits.kernel_memory_mb) and one was killed; the kernel was stopped and replaced, so all variables "
            "are lost",
        )


class Kernel:
    """One kernel process, its client and its scratch directory."""

    def __init__(self, manager: AsyncKernelManager, scratch: Path, slot: int, cgroups: Cgroups | None = None):
        self.manager = manager
        self.cgroups = cgroups  # its pool's kernel cgroups, if kernels get one
        self.client = manager.client(context=manager.context)
        self.scratch = scratch
        self.slot = slot
        self.runs = 0  # stateless runs served, resets and warm-up not counted
        self.reuse_limit = 0  # stateless runs before replacement; set by the pool
        self.lent = False  # out for one stateless run, after which it comes back (counted by the pool as coming)
        self.dead = False
        self.unclean: str | None = None  # why its scratch dir was left unemptied after a worker: it must not serve
        self.closing = False  # shutdown() was called
        self._stopping = asyncio.Lock()

    @property
    def process(self) -> subprocess.Popen | None:
        """The kernel's first process, the leader of its own session and process group (jupyter_client's
        LocalProvisioner starts it); None before the start and once jupyter_client has reaped it."""
        return getattr(getattr(self.manager, "provisioner", None), "process", None)

    def exited(self) -> bool:
        """Whether the kernel's first process has exited (or never started), without reaping it.

        Unreaped, its pid stays taken, so the signals sent to its process group (interrupt, caps, shutdown) reach
        the kernel's processes only; Popen.poll(), which jupyter_client's is_alive() uses, reaps it and frees the
        id for the next new process.
        """
        process = self.process
        if process is None or process.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped by someone else
            return True

    def exit_status(self) -> int | None:
        """The kernel's first process's exit status, as subprocess gives it (-N for signal N; a namespace init's
        128 + N read the same way), without reaping it; None while it runs or when it cannot be read."""
        process = self.process
        if process is None:
            return None
        if process.returncode is not None:
            return signal_status(process.returncode)
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is None:
            return None
        if info.si_code == os.CLD_EXITED:
            return signal_status(info.si_status)
        return -info.si_status  # killed or dumped by signal si_status

    async def execute(
        self,
        code: str,
        timeout_s: float,
        settings: PoolSettings,
        *,
        user: bool = True,
        output_limit_bytes: int | None = None,
        worker: str | None = None,
    ) -> RunResult:
        """Run `code`; never raises for anything the code does.

        `worker` (a kernel of pool.clean_state fork): "call" runs it in a new worker forked from the kernel's
        template, "session" in the kernel's session worker (started by its first call), "end" ends that worker;
        None runs it in the kernel itself (stare_sandbox.template). A worker that dies under the code gives the
        result a dead kernel's would (sandbox_error, its `exit_status`), but the kernel lives on.
        Each of stdout and stderr keeps settings.output_limit_chars characters (head and tail), or, given
        output_limit_bytes, its first that many bytes (/run_code, as SandboxFusion). Files a /run_code driver
        fetched come back in the result's `files`, and a kernel that died under the code gives its `exit_status`.

        The per-call caps (settings.limits: call_cpu_s, kernel_memory_mb through the kernel's cgroup, scratch_mb)
        are checked every CAP_CHECK_S while the code runs and, but CPU, once after; a call over one is stopped and
        the kernel killed (the caller replaces it, which also removes its files). Our own code (`user=False`:
        warm-up, reset) is held to the memory cap only: without cgroups, reading CPU time scans all of /proc.
        """
        started = time.perf_counter()
        if output_limit_bytes is None:
            stdout, stderr = _Capture(settings.output_limit_chars), _Capture(settings.output_limit_chars)
        else:
            stdout, stderr = _Head(output_limit_bytes), _Head(output_limit_bytes)
        files: dict[str, str] = {}
        exit_status: int | None = None
        never_ran = False  # the code certainly never started: a stateless call may run again on another kernel
        confirmed = False  # the kernel relayed the worker's own report that this call's code finished
        # What the call's worker left in the scratch dir before the template emptied it: 0 unless reported, for a
        # worker that ends before the reply; None (walk the dir) for one that runs on (a session's)
        left_in_scratch: int | None = 0 if worker in ("call", "end") else None
        limits = settings.limits if user else dataclasses.replace(settings.limits, call_cpu_s=0.0, scratch_mb=0)
        caps = await _CallCaps.begin(self, timeout_s, limits)
        msg_id = self._send_execute(code, worker)
        error: ErrorInfo | None = None
        status = "ok"
        deadline = time.monotonic() + timeout_s
        interrupted_at: float | None = None
        next_check = time.monotonic() + CAP_CHECK_S
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CAP_CHECK_S
                if (over := await caps.exceeded(during=True)) is not None:
                    status, error = over
                    break
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
                if self.exited():
                    self.dead = True
                    exit_status = self.exit_status()
                    await asyncio.to_thread(caps.meter.kill)  # what the kernel started dies with it, also here
                    status, error = caps.memory_exceeded() or ("sandbox_error", _kernel_died(exit_status))
                    # it exits so only while no worker call runs (relay.TemplateWatch): this one never began
                    never_ran = status == "sandbox_error" and exit_status == TEMPLATE_GONE_EXIT
                    break
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (stdout if content.get("name") == "stdout" else stderr).add(content.get("text", ""))
            elif kind == "display_data" and FETCH_MIME in content.get("data", {}):
                files = content["data"][FETCH_MIME]
            elif kind == "display_data" and worker is not None and WORKER_END_MIME in content.get("data", {}):
                ending = content["data"][WORKER_END_MIME]
                left_in_scratch = int(ending.get("scratch_bytes") or 0)
                if ending.get("unclean"):
                    self.unclean = str(ending["unclean"])
                if ending.get("gone"):  # the call's result stands, but the kernel cannot serve again
                    self.dead = True
            elif kind == "display_data" and worker is not None and WORKER_DONE_MIME in content.get("data", {}):
                confirmed = confirmed or content["data"][WORKER_DONE_MIME].get("call") == msg_id
            elif kind in ("execute_result", "display_data"):
                text = content.get("data", {}).get("text/plain")
                if text is not None and kind == "execute_result":
                    stdout.add(text + "\n")
            elif kind == "error":
                name = content.get("ename", "Error")
                traceback = ANSI.sub("", "\n".join(content.get("traceback", [])))
                error = ErrorInfo(name=name, message=content.get("evalue", ""), traceback=traceback)
                if worker is not None and name == WORKER_EXIT_ERROR:
                    exit_status, ran = _worker_exit(content.get("evalue", ""))
                    status, error, never_ran = "sandbox_error", _worker_died(exit_status), not ran
                elif worker is not None and name == RELAY_ERROR:
                    self.dead = True
                    status, error, ran = "sandbox_error", *_relay_failed(content.get("evalue", ""))
                    never_ran = not ran
                elif interrupted_at is not None and name == "KeyboardInterrupt":
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
        if worker is not None and not confirmed and not self.dead and status != "sandbox_error":
            # An answer without the worker's report of this call: its output may be lost, so never an ok
            self.dead = True
            status, error = "sandbox_error", _unconfirmed(worker)
        if not self.dead and (over := await caps.exceeded(during=False, scratch_left=left_in_scratch)):
            status, error = over
        await self._drain_shell()
        result = RunResult(
            status=status,
            stdout=stdout.text(),
            stderr=stderr.text(),
            error=error,
            truncated=stdout.truncated or stderr.truncated,
            duration_ms=(time.perf_counter() - started) * 1000,
        )
        result._files, result._exit_status = files, exit_status if status == "sandbox_error" else None
        result._never_ran = never_ran and status == "sandbox_error"
        return result

    def _send_execute(self, code: str, worker: str | None) -> str:
        """Send an execute request (its metadata names the worker, if any); its msg_id.

        stop_on_error=False: otherwise ipykernel may answer "aborted" to the call after an error or interrupt."""
        content = {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": False,
        }
        metadata = {WORKER_KEY: worker} if worker is not None else {}
        msg = self.client.session.msg("execute_request", content, metadata=metadata)
        self.client.shell_channel.send(msg)
        return msg["header"]["msg_id"]

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
                    await self._stop_process()
            remove_scratch(self.scratch)
            # Frees the kernel's sockets, in this (the event loop's) thread: its asyncio sockets are registered
            # with this loop, and destroying the context from another thread left ~1000 file descriptors open
            # (measured) until zmq ran out of sockets. The heartbeat thread was stopped above.
            with contextlib.suppress(Exception):
                self.manager.context.destroy(linger=0)

    async def _stop_process(self) -> None:
        if self.process.returncode is None:  # alive, or exited but not reaped: its group id is still the kernel's
            await self.manager.shutdown_kernel(now=True)  # SIGINT, then SIGKILL to the group; reaps it
            return
        # Reaped already (jupyter_client's wait_for_ready polls it while it starts): shutdown_kernel would still
        # signal its group id, which a new process may hold by now. Forget the process and free the rest.
        await self.manager.provisioner.wait()
        await self.manager.cleanup_resources()

    def kill_now(self) -> None:
        """`shutdown` without an event loop: SIGKILL the kernel's process group, reap it, remove the scratch dir."""
        process = self.process
        if process is not None:
            if process.returncode is None:  # not reaped yet: the group id is still its own (see _stop_process)
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)  # its own group: jupyter_client starts it in a new session
            with contextlib.suppress(Exception):
                process.wait(timeout=5)
        remove_scratch(self.scratch)


def _kernel_died(exit_status: int | None) -> ErrorInfo:
    if exit_status == TEMPLATE_GONE_EXIT:
        what = "the kernel's template process died (killed, e.g. by the OOM killer or by code run earlier) and the "
        what += "kernel exited with it"
    else:
        what = "the kernel process exited while running this code (e.g. a crash or os._exit)"
    message = f"{what}; all variables are lost and the next call runs on a fresh kernel"
    return ErrorInfo(name="KernelDied", message=message)


def _fields(evalue: str) -> dict:
    """The fields of an error the kernel made up for a call its worker did not report (relay.EXIT_ERROR,
    relay.RELAY_ERROR); {} when the message is not theirs."""
    try:
        fields = json.loads(evalue)
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _relay_failed(evalue: str) -> tuple[ErrorInfo, bool]:
    """The error of a call the kernel could not run as designed (relay.RELAY_ERROR), and whether its code may have
    started (True when the message does not say)."""
    fields = _fields(evalue)
    why, ran = str(fields.get("why", evalue)), bool(fields.get("ran", True))
    started = "its code may have run in part" if ran else "its code never ran"
    message = f"{why}; {started}, and the kernel is replaced, so all variables are lost"
    return ErrorInfo(name="KernelFailed", message=message), ran


def _unconfirmed(worker: str) -> ErrorInfo:
    return ErrorInfo(
        name="KernelFailed",
        message=f"the kernel answered this call ({worker}) without its worker's report that the code finished, so its "
        "output may be incomplete; the kernel is replaced, so all variables are lost",
    )


def _worker_exit(evalue: str) -> tuple[int | None, bool]:
    """The exit status of a worker that ended without finishing its cell (relay.EXIT_ERROR), and whether it had
    begun the cell (True when the message does not say)."""
    fields = _fields(evalue)
    return _int_or_none(str(fields.get("status"))), bool(fields.get("ran", True))


def _worker_died(status: int | None) -> ErrorInfo:
    return ErrorInfo(
        name="KernelDied",
        message=f"the process running this code exited (status {status}) before the code finished, e.g. a crash or "
        "os._exit; all variables are lost and the next call starts from a clean interpreter",
    )


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _cancel_requested() -> bool:
    """Whether the current task is being cancelled (Python 3.11 tells; before, assume it is)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0
