"""The warm kernel pool: starts kernels ahead of demand, hands them out, resets or retires them after use.

Every kernel (kernel.py) runs in its own scratch directory, under the isolation of `stare_sandbox.isolation`,
with numpy and sympy imported before it is handed out. How user code finds a clean interpreter is
`clean_state`:

- `fork` (the default): the kernel is `stare_sandbox.template`. User code never runs in the kernel itself but in a
  worker process forked from a clean template inside the kernel's fences: a stateless run gets a new worker that
  exits after it, a stateful session (sessions.py) one worker for its life. Nothing a run changes in its interpreter
  (modules, `sys` settings, builtins, environment, cwd, open files, threads, atexit and signal handlers) reaches a
  later run or session. When a worker ends, the template empties the scratch dir before the kernel answers, so the
  kernel serves again at once, with no reset; a session's kernel comes back to the pool like a stateless run's, so
  a new session needs no start;
- `reset` (the pool before workers, kept as a baseline): a stateless run runs in the kernel, which then wipes its
  namespace and scratch dir (`RESET_CODE`). Modules stay imported, so a run that patches a module affects later
  runs on the same kernel until it is replaced; a session keeps its kernel and retires it afterwards.

Either way a kernel is replaced after `stateless_reuse` runs or after anything unusual (timeout, death); set
`stateless_reuse = 0` for a fresh process every run (slower: one kernel start per call).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import collections
import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, get_args

import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager

from stare_sandbox.cgroups import (
    Cgroups,
    cgroup_problem,
    cpu_seconds,
    prepare_cgroups,
    range_group,
    remove_cgroup_dirs,
    sweep_cgroups,
    usable_cgroups,
)
from stare_sandbox.isolation import (
    UID_BASE,
    Isolation,
    IsolationMode,
    Limits,
    detect_isolation,
    kernel_argv,
    kernel_env,
    make_scratch,
    remove_scratch,
    scratch_prefix,
)
from stare_sandbox.kernel import Kernel, KernelsBusy, SandboxError
from stare_sandbox.ownership import Owner, check_uid_base, claim_uid_range
from stare_sandbox.processes import kill_processes_with_home
from stare_sandbox.template import encode_warmup

log = logging.getLogger("sandbox")
T = TypeVar("T")
CleanState = Literal["fork", "reset"]

# Runs after a stateless call with clean_state reset: forget the user's names, restore cwd, empty the scratch dir
# (warm-up follows). Not %reset: it runs a full gc.collect, ~70 ms with numpy and sympy loaded.
RESET_CODE = """\
def _sandbox_reset():
    import os

    from stare_sandbox.isolation import empty_scratch

    shell = get_ipython()
    for name in [n for n in shell.user_ns if n not in shell.user_ns_hidden]:
        del shell.user_ns[name]
    os.chdir(os.environ["HOME"])
    empty_scratch(".")


_sandbox_reset()
"""


@dataclass(frozen=True)
class PoolSettings:
    """How kernels are started, limited and reused."""

    pool_size: int = 4
    """Warm kernels kept ready (numpy and sympy imported); kernels started for a burst beyond it retire after it."""
    max_kernels: int = 64
    """Kernels alive at once: sessions plus the pool. Also the number of distinct kernel uids."""
    isolation: IsolationMode = "auto"
    """auto: namespaces where they work, else process isolation; namespaces: require them."""
    clean_state: CleanState = "fork"
    """fork: user code runs in processes forked from a clean template in each kernel, a new one per stateless run
    and per session (nothing one run changes reaches another); reset: in the kernel itself, whose user namespace
    and scratch dir are wiped after a stateless run (modules, sys settings and the like persist), a session
    retiring its kernel (the pool before forked workers, kept as a baseline)."""
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
    stateless_reuse: int = 100
    """At most this many stateless runs a kernel serves (reset between them) before it is replaced: each
    kernel's own limit is drawn uniformly from [1, n] (mean about n/2), so kernels started together do not
    retire together; 0 = a fresh kernel every run."""
    max_starting: int = field(
        default_factory=lambda: len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    )
    """Kernels starting at once, always in the background (default: the cores this process may use). A call
    never starts a kernel itself: it waits for one, and starts beyond this bound wait their turn. 0 = no bound,
    one start per waiting call at once, as before this setting (on 2 cores ~30 concurrent starts stalled every
    call for 10+ s); kept for before/after benchmarks."""
    queue_wait_s: float = 30.0
    """How long a call waits for a ready kernel before it is refused: a stateless call then gets HTTP 503 with
    Retry-After (its code never ran, so clients retry it), creating a session 503 too. Keep it below the
    clients' HTTP timeout, so that a burst beyond capacity is answered instead of timing out."""
    scratch_root: str = ""
    """Where scratch directories are made; empty = a new folder in the system temp dir."""
    warmup_code: str = "import math\nimport numpy as np\nimport sympy as sp\n"
    """Run in every new kernel before it is handed out."""
    uid_base: int = 0
    """First uid of the kernel uid range this pool holds exclusively on the host (stare_sandbox.ownership): 61000,
    62000, ... 99000 (not 65000); 0 = the first range no other pool holds. A range another pool holds is refused."""
    cgroups: bool = True
    """Put each kernel in its own cgroup where cgroups work (memory cap for all its processes, their CPU time
    counted together); False = rlimits only."""

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
        if self.max_starting < 0:
            raise ValueError(f"max_starting must be >= 0 (0 = no bound); got {self.max_starting}")
        if self.queue_wait_s <= 0:
            raise ValueError(f"queue_wait_s must be > 0; got {self.queue_wait_s}")
        check_uid_base(self.uid_base, self.max_kernels)
        if self.clean_state not in get_args(CleanState):
            raise ValueError(f"clean_state must be one of {', '.join(get_args(CleanState))}; got {self.clean_state!r}")

    @property
    def forks(self) -> bool:
        """Whether user code runs in forked workers (clean_state fork)."""
        return self.clean_state == "fork"


class _SandboxKernelManager(AsyncKernelManager):
    """Starts the kernel with this kernel's own argv (its uid differs per kernel) instead of the spec's."""

    sandbox_argv: list[str] = []

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return [arg.replace("{connection_file}", self.connection_file) for arg in self.sandbox_argv]


def reuse_limit(stateless_reuse: int) -> int:
    """A new kernel's own limit of stateless runs: uniform in [1, stateless_reuse] (0: none, a fresh kernel a run).

    Kernels that start together (the pool at start, a burst) serve their runs in turn, so with one shared limit
    they retired in the same second and every call waited for starts (docs/sandbox.md, stateless at concurrency
    32). Limits drawn from [n/2, n] still retired a pool's first kernels within a few seconds of each other (a
    third of the throughput while they restarted, in the burst benchmark's third cell); from [1, n] the first
    retirements are spread over the whole of a kernel's life, and so are all later ones.
    """
    return random.randint(1, stateless_reuse) if stateless_reuse else 0


class KernelPool:
    """Starts kernels ahead of demand and hands them out; knows nothing about HTTP.

    The pool keeps `pool_size` kernels ready (or coming back, below), and one more for each call waiting beyond the
    kernels starting or being reset (`_shortfall`). Kernels are started only in the background (`_refill`), at most
    `max_starting` at once, so a burst never has every call starting its own kernel on cores that are busy running
    code. A call takes a ready kernel or waits, first come first served, for the next one a start brings or a reset
    gives back, up to `queue_wait_s` (then `KernelsBusy`).
    A kernel lent for a stateless run that is not its last counts as coming back, as one being reset does; one a
    session takes, or one whose run is its last (`reuse_limit`), leaves a shortfall that starts a successor at
    once. A waiting call starts a kernel only when none is starting or being reset for it, so on a fully lent
    pool it waits for the next reset rather than a start (why, with the costs: docs/sandbox.md).
    """

    FAILURE_CAUSES = ("timeout", "died", "warmup", "error")
    """Why a kernel start failed: not ready within startup_timeout_s; its process exited while starting; the
    warm-up code failed; anything else (e.g. it could not be launched). Cancellation at shutdown is none."""
    RETIRE_CAUSES = ("reused", "died", "reset_failed", "surplus", "session")
    """Why a kernel was retired (stopped while the pool runs): it served its reuse_limit of stateless runs; it
    died (found dead after a call, or before a call would take it); its reset after a run failed; it came back
    when pool_size were ready already and no call waited; its session was closed or expired. Stops at close()
    are none."""
    WAIT_BUCKETS_S = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
    """Upper bounds (inclusive) of the buckets of `wait_counts`; its last bucket holds longer waits."""
    START_RETRY_S = 1.0
    """After a failed start no new start begins for this long, so that a broken setup does not spin."""

    def __init__(self, settings: PoolSettings):
        self.settings = settings
        self.isolation: Isolation | None = None
        # Warm idle kernels. Never non-empty while calls wait: a kernel that becomes ready goes to a waiting call.
        self._ready: collections.deque[Kernel] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Kernel]] = collections.deque()  # waiting calls, oldest first
        self._free_slots = list(range(settings.max_kernels))
        self._background: set[asyncio.Task] = set()
        self._starting = 0  # kernels being started; each holds a slot
        self._returning = 0  # stateless kernels being reset that will be ready again
        self._lent = 0  # kernels out for a stateless run after which they come back (Kernel.lent)
        self._handed = 0  # kernels handed to a waiting call that has not resumed yet to take them (_hand)
        self._retry_at = 0.0  # time.monotonic() before which no start begins (set after a failed start)
        self._closed = False
        # Every kernel whose process may exist: starting, ready, in use (session or stateless run) or resetting.
        self._kernels: set[Kernel] = set()
        self._owns_root = not settings.scratch_root
        self._root: Path | None = Path(settings.scratch_root) if settings.scratch_root else None
        self._specs: KernelSpecManager | None = None
        # Counts for /healthz and /metrics (they only grow).
        self.kernels_started = 0
        self.start_failures_by_cause: collections.Counter[str] = collections.Counter()  # keys: FAILURE_CAUSES
        self.retired_by_cause: collections.Counter[str] = collections.Counter()  # keys: RETIRE_CAUSES
        self.starting_peak = 0  # most kernels starting at once so far: at most max_starting when that is > 0
        self.waits_refused = 0  # calls that got no kernel within queue_wait_s (KernelsBusy)
        self.calls_rerun = 0  # stateless calls run once more: they failed before any of their code started
        self.wait_counts = [0] * (len(self.WAIT_BUCKETS_S) + 1)  # acquire calls by seconds waited, per bucket
        self.wait_sum_s = 0.0

    _owner: Owner | None = None  # the kernel uid range, held from start() to close()
    _cgroups: Cgroups | None = None  # where the kernels' cgroups are, if they get any

    async def start(self) -> None:
        """Probe the isolation, claim a uid range, make the scratch root and start filling the pool; on failure (or
        cancellation) everything made so far is removed again."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        isolation = await asyncio.to_thread(detect_isolation, self.settings.isolation, self.settings.cgroups)
        # The pool's own uid range: its slots are those uids less UID_BASE. What a previous owner of the range
        # left when it died without its clean-up is ended and removed before any kernel starts.
        self._owner = await asyncio.to_thread(claim_uid_range, self.settings.uid_base, self.settings.max_kernels)
        atexit.register(self._remove_leftovers)
        self.isolation = dataclasses.replace(isolation, uid_base=self._owner.first)
        self._cgroups = usable_cgroups() if isolation.cgroup else None
        reclaimed = await asyncio.to_thread(self._owner.reclaim)
        if self._owner.previous:
            log.warning(
                "kernel uids %d-%d: their previous owner stopped without its clean-up; %s",
                self._owner.first,
                self._owner.last,
                reclaimed,
            )
        self._free_slots = self._owner.slots(self.settings.max_kernels)
        if self._cgroups is not None:
            await asyncio.to_thread(prepare_cgroups, self._cgroups)
        if self._root is None:  # made here, not in __init__: a pool never started leaves nothing on disk
            self._root = Path(tempfile.mkdtemp(prefix="sandbox-"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._owner.record(scratch_root=self._root, owns_root=self._owns_root, cgroups=self._cgroups)
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
        return len(self._ready)

    def kernels_cpu_seconds(self) -> float | None:
        """CPU seconds used so far by all the kernels this pool started, retired ones and their workers included
        (the cgroup of its uid range holds theirs); None where kernels get no cgroup."""
        if self._cgroups is None or self.isolation is None:
            return None
        return cpu_seconds(self._cgroups, self._cgroups.dirs[-1] / range_group(self.isolation.uid_base))

    def caps(self) -> dict[str, object]:
        """The caps in force and what enforces them, for /healthz."""
        limits = self.settings.limits
        cgroup = self.isolation.cgroup if self.isolation is not None else ""
        if cgroup:
            memory_by, why = f"cgroup {cgroup} per kernel, rlimit per process", None
        else:
            memory_by = "rlimit per process"
            why = cgroup_problem() if self.settings.cgroups else "pool.cgroups is off"
        first = self._owner.first if self._owner is not None else None
        return {
            "uid_range": [first, first + self.settings.max_kernels - 1] if first is not None else None,
            "memory": {
                "by": memory_by,
                "kernel_mb": limits.kernel_memory_mb if cgroup else None,
                "process_mb": limits.memory_mb,
                "no_cgroup_because": why,
            },
            "call_cpu_s": {"by": f"cgroup {cgroup}" if cgroup else "session", "seconds": limits.call_cpu_s or None},
            "scratch_mb": limits.scratch_mb or None,
            "processes": limits.processes,
            "file_size_mb": limits.file_size_mb,
            "open_files": limits.open_files,
        }

    @property
    def alive_count(self) -> int:
        return self.settings.max_kernels - len(self._free_slots)

    @property
    def starting_count(self) -> int:
        return self._starting

    @property
    def waiting_count(self) -> int:
        """Calls waiting for a kernel."""
        return len(self._waiters)

    @property
    def start_failures(self) -> int:
        return sum(self.start_failures_by_cause.values())

    async def acquire(self, wait_s: float | None = None, *, stateless: bool = False) -> Kernel:
        """A warm kernel: a ready one, else the next one a start or a reset brings, first come first served.

        `stateless`: for one run, after which the caller gives it back (give_back_later); unless the run is its
        last, it counts as coming back meanwhile, and no successor starts for it.
        Raises KernelsBusy when none comes within `wait_s` (default queue_wait_s; less for a call that waited
        for a run slot first) because every kernel is held or starts cannot keep up with the calls, SandboxError
        when the pool is closed.
        """
        if self._closed:
            raise SandboxError("the kernel pool is closed (the sandbox is shutting down)")
        began = time.monotonic()
        wait_s = self.settings.queue_wait_s if wait_s is None else wait_s
        kernel = self._take_ready() or await self._wait_for_kernel(began, wait_s)
        self._record_wait(time.monotonic() - began)
        if stateless and kernel.runs + 1 < kernel.reuse_limit:
            kernel.lent = True
            self._lent += 1
        self._refill()  # the shortfall this leaves starts a successor now, while the call runs
        return kernel

    def _take_ready(self) -> Kernel | None:
        """The oldest ready kernel whose process still runs, or None. One that died while it waited (the OOM
        killer, a SIGKILL) is retired on the way, which frees its slot for a successor, instead of being handed out
        to fail the call with KernelDied."""
        while self._ready:
            kernel = self._ready.popleft()
            if not kernel.exited():
                return kernel
            log.warning("a ready kernel (slot %d) had exited; it is replaced", kernel.slot)
            kernel.dead = True
            self._spawn(self.discard(kernel, "died"))
        return None

    async def _wait_for_kernel(self, began: float, wait_s: float) -> Kernel:
        waiter: asyncio.Future[Kernel] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._refill()  # a waiting call counts as demand: a start begins now if max_starting allows
        try:
            # Shielded: only this method cancels `waiter`, so a kernel handed to it is found below, never lost.
            kernel = await _wait_for(asyncio.shield(waiter), max(wait_s, 0.0))
            self._handed -= 1
            return kernel
        except asyncio.TimeoutError:
            if self._was_handed(waiter):  # it came in the same loop turn as the timeout
                self._handed -= 1
                return waiter.result()
            self.waits_refused += 1
            self._record_wait(time.monotonic() - began)
            raise KernelsBusy(
                f"no kernel became free within queue_wait_s={self.settings.queue_wait_s:g}s "
                f"({len(self._waiters)} calls waiting, {self._starting} kernels starting, "
                f"{self.alive_count} of max_kernels={self.settings.max_kernels} alive); retry later"
            ) from None
        except BaseException:
            if self._was_handed(waiter):  # cancelled as the kernel came: it goes to the next call instead
                self._handed -= 1
                self._hand(waiter.result())
            raise
        finally:
            waiter.cancel()  # nothing when it is done
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    @staticmethod
    def _was_handed(waiter: asyncio.Future[Kernel]) -> bool:
        return waiter.done() and not waiter.cancelled() and waiter.exception() is None

    def _hand(self, kernel: Kernel) -> None:
        """A kernel that is ready goes to the call that has waited longest, else joins the ready ones, else (pool_size
        are ready) retires: a burst starts a kernel per waiting call, and without this they all came back to stay."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(kernel)
                self._handed += 1  # coming, until the call resumes and takes it (acquire counts it from there)
                return
        if len(self._ready) >= self.settings.pool_size:
            self._spawn(self.discard(kernel, "surplus"))
        else:
            self._ready.append(kernel)

    def _record_wait(self, seconds: float) -> None:
        self.wait_counts[bisect.bisect_left(self.WAIT_BUCKETS_S, seconds)] += 1
        self.wait_sum_s += seconds

    def give_back_later(self, kernel: Kernel) -> None:
        """After a stateless run, make the kernel ready again or retire it (dead, its reuse_limit reached, its scratch
        dir not emptied, or the pool closing). With clean_state reset the kernel is reset first, in the background so
        that the caller's result is not delayed; with fork there is nothing left to reset (the run's worker has
        ended, and the template emptied the scratch dir after it: Kernel.unclean says if it could not).

        A kernel to be reset counts as coming from now on (as it did while lent), so no start begins on its account.
        One that retires does not count: if the run was its last, its successor began when the call took it
        (acquire); if it died, a successor starts once it is stopped (discard), if the pool needs one.
        """
        if kernel.lent:
            kernel.lent = False
            self._lent -= 1
        returning = not kernel.dead and kernel.runs < kernel.reuse_limit and not self._closed
        if self.settings.forks:  # no reset: the run's worker is gone, and the template emptied the scratch dir
            if returning and kernel.unclean is None:
                self._hand(kernel)
            else:
                cause = "died" if kernel.dead else "reset_failed" if returning else "reused"
                if kernel.unclean is not None:
                    log.warning("kernel %d retires: its scratch dir was not emptied (%s)", kernel.slot, kernel.unclean)
                self._spawn(self.discard(kernel, cause))
            return
        self._returning += returning
        self._spawn(self._reset_or_retire(kernel, returning))

    async def _reset_or_retire(self, kernel: Kernel, returning: bool) -> None:
        try:
            reset_ok = False
            if returning:
                reset = await kernel.execute(RESET_CODE + self.settings.warmup_code, 30.0, self.settings, user=False)
                reset_ok = reset.status == "ok" and not kernel.dead and not self._closed
        except BaseException:
            self._returning -= returning
            await _run_to_end(self.discard(kernel, "reset_failed"))
            raise
        self._returning -= returning
        if reset_ok:
            self._hand(kernel)
        else:
            await self.discard(kernel, "died" if kernel.dead else "reset_failed" if returning else "reused")

    async def discard(self, kernel: Kernel, cause: str | None = None) -> None:
        """Stop a kernel that will not be used again; its slot is free again for a successor. `cause` (one of
        RETIRE_CAUSES) is counted in retired_by_cause, unless the pool is closing."""
        if cause is not None and not self._closed:
            self.retired_by_cause[cause] += 1
        if kernel.lent:  # it was counted as coming back (a session's kernel that died, with clean_state fork)
            kernel.lent = False
            self._lent -= 1
        await self._stop(kernel)
        self._free_slots.append(kernel.slot)
        self._refill()

    async def close(self) -> None:
        """Kill every kernel of the pool and remove every scratch dir, whatever the kernels are doing.

        Also kernels that are starting, resetting, or held by a session or a stateless run whose caller will never
        give them back: asyncio.run, interrupted (Ctrl-C, or SIGTERM turned into an exception by the CLI), cancels
        every task at once, those callers too. Calls waiting for a kernel get a SandboxError at once. Goes on to
        the end when the calling task is cancelled meanwhile.
        """
        self._closed = True
        await _run_to_end(self._close())

    async def _close(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(SandboxError("the kernel pool was closed while this call waited for a kernel"))
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(self._stop(kernel) for kernel in list(self._kernels)), return_exceptions=True)
        self._ready.clear()
        await asyncio.to_thread(self._release)
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
        self._release()

    def _release(self) -> None:
        """Once the kernels are stopped: end what they started and left running, remove the scratch root and the
        kernels' cgroups, and give up the uid range (also when a step before fails)."""
        try:
            if self._owner is not None and self._cgroups is not None:
                sweep_cgroups(self._cgroups, range_group(self._owner.first))
                remove_cgroup_dirs(self._cgroups)
        finally:
            try:
                if self._owns_root and self._root is not None:
                    # without cgroups, what process-mode kernels started is found by its HOME: a scratch dir of
                    # this root, which is this pool's alone (a shared scratch_root could hold another pool's kernels)
                    if self.isolation is not None and not self.isolation.unprivileged_user:
                        kill_processes_with_home(f"{self._root}/{scratch_prefix(os.getpid())}")
                    shutil.rmtree(self._root, ignore_errors=True)
            finally:
                if self._owner is not None:
                    self._owner.release()

    async def _stop(self, kernel: Kernel) -> None:
        await kernel.shutdown()
        self._kernels.discard(kernel)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _refill(self) -> None:
        """Start kernels in the background while fewer than pool_size would be ready beyond the waiting calls
        (starts under way and kernels being reset count as coming), at most max_starting at once.

        The bound keeps a burst from collapsing: many starts at once on few cores slow every one of them while all
        calls wait (docs/sandbox.md, stateless at concurrency 32).
        """
        if self._closed or self._specs is None or time.monotonic() < self._retry_at:
            return  # closed, not started yet (start() refills at its end), or pausing after a failed start
        bound = self.settings.max_starting or self.settings.max_kernels  # 0: no bound but the slots
        while self._free_slots and self._starting < bound and self._shortfall() > 0:
            self._starting += 1
            self.starting_peak = max(self.starting_peak, self._starting)
            self._spawn(self._start_in_background(self._free_slots.pop(0)))

    def _shortfall(self) -> int:
        """Kernels to start: up to pool_size ready, starting, being reset, lent to stateless calls or handed to a
        call; and a start for each waiting call beyond the kernels starting or being reset, one of which it gets
        first (a reset takes milliseconds, a start about a second). Counting the waiting calls on top of pool_size
        started, on a saturated pool, a kernel for each call that waited for a reset or a successor: ~0.5 CPU-s
        each, for a kernel that then retired as surplus."""
        coming = len(self._ready) + self._starting + self._returning + self._lent + self._handed
        waiting = len(self._waiters) - len(self._ready) - self._starting - self._returning
        return max(self.settings.pool_size - coming, waiting)

    async def _start_in_background(self, slot: int) -> None:
        try:
            kernel = await self._start_kernel(slot)
        except SandboxError as exc:
            self._starting -= 1
            if self._closed:
                return
            log.warning("could not start a kernel: %s (next start in %g s)", exc, self.START_RETRY_S)
            self._retry_at = time.monotonic() + self.START_RETRY_S
            await asyncio.sleep(self.START_RETRY_S)
            self._refill()
            return
        except BaseException:
            self._starting -= 1
            raise
        self._starting -= 1
        self._hand(kernel)
        self._refill()  # one start fewer under way: the next may begin

    async def _start_kernel(self, slot: int) -> Kernel:
        """A warm kernel in `slot` (taken by the caller). On failure or cancellation nothing is left behind: no
        process, no scratch dir, and the slot is free again."""
        assert self._specs is not None and self.isolation is not None, "KernelPool.start() was not awaited"
        began = time.monotonic()
        scratch: Path | None = None
        kernel: Kernel | None = None
        cause: str | None = None  # known here for a warm-up failure, else found from the exception
        try:
            if self._closed:
                raise SandboxError("the kernel pool is closed (the sandbox is shutting down)")
            uid = UID_BASE + slot if self.isolation.unprivileged_user else None
            scratch = make_scratch(self._root, uid)
            # The kernel's own zmq context, shared by its manager and client and destroyed by Kernel.shutdown once
            # both are stopped, with linger 0 (jupyter_client's own contexts are destroyed with linger 100, once per
            # client and manager, and that once blocked for good for a client stopped mid-start).
            manager = _SandboxKernelManager(
                kernel_name="sandbox", kernel_spec_manager=self._specs, context=zmq.asyncio.Context()
            )
            warmup = encode_warmup(self.settings.warmup_code) if self.settings.forks else ""
            manager.sandbox_argv = kernel_argv(self.isolation, self.settings.limits, uid, template_warmup=warmup)
            manager.transport = "ipc"
            manager.ip = str(scratch / "ipc")
            manager.connection_file = str(scratch / "kernel.json")
            kernel = Kernel(manager, scratch, slot, self._cgroups)
            self._kernels.add(kernel)
            kernel.reuse_limit = reuse_limit(self.settings.stateless_reuse)
            await _wait_for(manager.start_kernel(env=kernel_env(scratch)), self.settings.startup_timeout_s)
            kernel.client = manager.client(context=manager.context)
            # No heartbeat thread: liveness comes from the manager (the client's parent), and jupyter_client's
            # HBChannel, stopped before its thread has set `_running`, spins creating REQ sockets until zmq
            # runs out of them ("Too many open files"), which a kernel stopped right after its start hit.
            kernel.client.start_channels(hb=False)
            await kernel.client.wait_for_ready(timeout=self.settings.startup_timeout_s)
            warm = await kernel.execute(
                self.settings.warmup_code, self.settings.startup_timeout_s, self.settings, user=False
            )
            if warm.status != "ok":
                cause = "timeout" if warm.status == "timeout" else "died" if kernel.dead else "warmup"
                raise SandboxError(f"warm-up failed: {warm.error.message if warm.error else warm.status}")
            if self._closed:  # close() ran while this kernel started and may have found no process yet
                raise SandboxError("the kernel pool was closed while this kernel started")
        except BaseException as exc:  # including cancellation at shutdown: never leave a process behind
            if not self._closed and not isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
                cause = cause or self._failure_cause(exc, kernel, time.monotonic() - began)
                self.start_failures_by_cause[cause] += 1
            if kernel is not None:
                await _run_to_end(self._stop(kernel))
            elif scratch is not None:
                remove_scratch(scratch)
            self._free_slots.append(slot)
            if isinstance(exc, (SandboxError, asyncio.CancelledError)) or not isinstance(exc, Exception):
                raise
            raise SandboxError(f"kernel did not start ({cause}): {type(exc).__name__}: {exc}") from exc
        self.kernels_started += 1
        return kernel

    def _failure_cause(self, exc: BaseException, kernel: Kernel | None, seconds: float) -> str:
        """One of FAILURE_CAUSES for a start that raised `exc` after `seconds`."""
        if isinstance(exc, TimeoutError) or seconds >= self.settings.startup_timeout_s:
            return "timeout"  # jupyter_client's wait_for_ready says so with a RuntimeError
        return "died" if kernel is not None and kernel.process is not None and kernel.exited() else "error"


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
