"""Kernels end with their owner: the parent-death signal, KernelPool.close in every state, the exit fallback.
And kernels are started ahead of demand: a bounded number at once, in the background, refilled after a burst.

Real kernels and real processes. An owner process is SIGKILLed (no clean-up of its own runs) and its
kernels must die by themselves; a pool closed while its kernels start, run or are held must leave no
process and no scratch dir. A process counts as a kernel's when it descends from the owner, or when its
command line, environment (kernels get HOME and TMPDIR = their scratch dir) or cwd names the test's
scratch root, so kernels of other tests in this process are never counted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from procs import _stat, alive, cmdline, descendants, processes_tied_to  # tests/procs.py

import stare_sandbox.isolation as isolation
import stare_sandbox.pool as pool_module
from stare_sandbox.client import SandboxClient, SandboxUnavailable
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.isolation import _PDEATHSIG_EXEC, Limits, detect_isolation
from stare_sandbox.kernel import Kernel, KernelsBusy, SandboxError
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.schemas import RunResult
from stare_sandbox.sessions import SessionStore, run_stateless

REPO = Path(__file__).resolve().parents[2]
DEATH_S = 5.0  # how long a kernel may take to die after its owner (measured: well under 0.1 s)


def wait_until_gone(processes: dict[int, int], timeout_s: float) -> tuple[list[int], float]:
    """(the processes still alive after at most timeout_s, seconds waited)."""
    started = time.monotonic()
    while (left := alive(processes)) and time.monotonic() - started < timeout_s:
        time.sleep(0.005)
    return left, time.monotonic() - started


def kill_all(processes: dict[int, int]) -> None:
    for pid in alive(processes):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def isolation_or_skip(mode: str) -> str:
    if mode == "namespaces" and detect_isolation("auto").mode != "namespaces":
        pytest.skip("namespace isolation is not available here (needs root and util-linux unshare)")
    return mode


# --- the parent-death signal -------------------------------------------------------------------------

# Starts `prefix + a sleeping python` the way jupyter_client starts a kernel, prints its pid, waits to be killed.
PREFIX_OWNER = """
import subprocess, sys, time
import stare_sandbox.isolation as isolation
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
child = subprocess.Popen([*isolation._die_with_parent(sys.executable), *sleeper], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_parent_death_prefix_kills_the_child_when_its_starter_dies():
    owner = subprocess.Popen([sys.executable, "-c", PREFIX_OWNER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = {}
    try:
        pid = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        # the prefix's own argv names the sleeper too, so the kill may land before its prctl: then it must not start
        while "sleep(600)" not in cmdline(pid):
            assert time.monotonic() < deadline, "the child never got to run the sleeping python"
            time.sleep(0.01)
        child = {pid: _stat(pid)[2]}
        owner.kill()
        owner.wait()
        left, waited = wait_until_gone(child, DEATH_S)
        assert left == [], f"the child outlived its starter by {waited:.1f} s"
    finally:
        owner.kill()
        owner.wait()
        kill_all(child)


def test_python_prefix_refuses_to_run_for_a_parent_that_is_gone():
    # the parent died before prctl: no signal would ever come, so the program must not be started at all
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, "1", sys.executable, "-c", "print('started')"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0 and "started" not in done.stdout
    assert "has exited" in done.stderr


# --- an owner killed with SIGKILL --------------------------------------------------------------------

# A pool with warm kernels, a stateful session and a stateless call in the middle of its run.
POOL_OWNER = """
import asyncio, sys
from pathlib import Path
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.pool import PoolSettings

async def main(root: Path, isolation: str, ready: Path) -> None:
    # pool_size 4: the kernels lent to the running call and (with forked workers) to the session count towards it
    # (they come back), so 2 stay ready
    settings = PoolSettings(pool_size=4, max_kernels=8, isolation=isolation, scratch_root=str(root))
    client = await InProcessClient(settings).start()
    session = await client.create_session()
    await client.execute("x = 1", session)
    code = "import time; open('running', 'w').close(); time.sleep(60)"
    running = asyncio.ensure_future(client.execute(code, timeout_s=100))
    while not list(root.glob("kernel-*/running")) or client.pool.ready_count < 2:
        await asyncio.sleep(0.05)
    ready.write_text("ready")
    await running

asyncio.run(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
"""


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_kernels_die_with_an_owner_killed_by_sigkill(tmp_path, isolation):
    """Warm kernels, a session's kernel and a kernel mid-run all die within DEATH_S of their owner.

    In process mode ipykernel's parent poller would end the kernels within a second anyway; in namespace
    mode only the parent-death signal on `unshare` does (remove it and this fails).
    """
    isolation_or_skip(isolation)
    root, ready = tmp_path / "scratch", tmp_path / "ready"
    argv = [sys.executable, "-c", POOL_OWNER, str(root), isolation, str(ready)]
    owner = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
    kernels: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert owner.poll() is None, f"the owner exited: {owner.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "the owner's kernels were not ready within 120 s"
            time.sleep(0.05)
        kernels = descendants(owner.pid)
        assert len(kernels) >= 4  # 2 warm, 1 session, 1 running (3 processes each with namespaces)
        owner.kill()
        owner.wait()
        left, waited = wait_until_gone(kernels, DEATH_S)
        assert left == [], f"{len(left)} kernel processes still alive {waited:.1f} s after their owner's SIGKILL"
        assert processes_tied_to(root) == []
    finally:
        owner.kill()
        owner.wait()
        kill_all(kernels)


# --- KernelPool.close --------------------------------------------------------------------------------


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The system temp dir, where a pool without scratch_root makes its root, is `tmp_path` for this test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def assert_nothing_left(tmp: Path) -> None:
    deadline = time.monotonic() + DEATH_S  # killed processes may take a moment to go
    while (left := processes_tied_to(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []
    assert sorted(p.name for p in tmp.iterdir()) == []


@pytest.mark.slow
def test_close_stops_kernels_that_are_held_running_or_starting(private_tmp):
    """A session, a stateless call mid-run, a kernel acquired and never given back, and pool kernels that are
    still starting: close() kills them all and removes the scratch root, without waiting for the running code."""

    async def go() -> None:
        client = await InProcessClient(PoolSettings(pool_size=2, max_kernels=8)).start()
        session = await client.create_session()
        assert (await client.execute("x = 1", session)).status == "ok"
        held = await client.pool.acquire()  # a caller that will never give it back
        code = "import time; open('running', 'w').close(); time.sleep(60)"
        running = asyncio.ensure_future(client.execute(code, timeout_s=100))
        while not list(private_tmp.glob("sandbox-*/kernel-*/running")):
            await asyncio.sleep(0.05)
        cancelled = asyncio.ensure_future(client.execute(code, timeout_s=100))
        while len(list(private_tmp.glob("sandbox-*/kernel-*/running"))) < 2:
            await asyncio.sleep(0.05)
        cancelled.cancel()  # as asyncio.run does to every task when interrupted
        assert held.scratch.exists()
        started = time.monotonic()
        await client.close()
        assert time.monotonic() - started < 20  # not the 60 s of the running code
        result = await running
        assert result.status == "sandbox_error"  # its kernel was killed under it

    asyncio.run(go())
    assert_nothing_left(private_tmp)


def test_close_finishes_even_when_its_caller_is_cancelled_again_and_again(private_tmp):
    async def go() -> None:
        pool = KernelPool(PoolSettings(pool_size=3, max_kernels=4))
        await pool.start()
        while pool.ready_count < 1:  # one ready, the others still starting
            await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(pool.close())
        for _ in range(5):
            await asyncio.sleep(0.02)
            closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing

    asyncio.run(go())
    assert_nothing_left(private_tmp)


def test_a_pool_never_started_leaves_nothing(private_tmp):
    async def go() -> None:
        KernelPool(PoolSettings())
        await KernelPool(PoolSettings()).close()

    asyncio.run(go())
    assert_nothing_left(private_tmp)


# The event loop ends with the pool still open, as when a KeyboardInterrupt escapes asyncio.run's loop while
# it cancels the tasks: close() never finishes, and only the exit-time fallback can remove the scratch dirs.
ABANDONED_OWNER = """
import asyncio
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.sessions import run_stateless

async def main() -> None:
    pool = KernelPool(PoolSettings(pool_size=2, max_kernels=4))
    await pool.start()
    while pool.ready_count < 2:
        await asyncio.sleep(0.05)
    print(len(pool._kernels), flush=True)

loop = asyncio.new_event_loop()
loop.run_until_complete(main())
"""


def test_kernels_and_scratch_are_removed_at_exit_when_close_never_ran(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", ABANDONED_OWNER], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2"
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_retired_kernels_release_their_sockets():
    """Kernels replaced one after another do not accumulate open files (zmq sockets, pipes) in the owner: a long
    run starts thousands, and leaked sockets end in 'Too many open files'."""

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def go() -> list[int]:
        pool = KernelPool(PoolSettings(pool_size=1, stateless_reuse=0))  # a fresh kernel for every run
        await pool.start()
        counts = []
        try:
            for i in range(25):
                assert (await run_stateless(pool, "print(7)", 10)).stdout == "7\n"
                if i in (4, 24):
                    await asyncio.sleep(0.5)  # retired kernels are stopped in the background (give_back_later)
                    counts.append(open_files())
        finally:
            await pool.close()
        return counts

    after_5, after_25 = asyncio.run(go())
    assert after_25 <= after_5 + 15, f"open files grew from {after_5} to {after_25} over 20 kernels"


def test_kernels_run_without_a_heartbeat_thread():
    """No jupyter_client heartbeat thread per kernel: the manager tells whether a kernel lives, and a heartbeat
    thread stopped before it got going spins making sockets until zmq runs out of them."""
    import threading

    from jupyter_client.channels import HBChannel

    async def go() -> list[threading.Thread]:
        pool = KernelPool(PoolSettings(pool_size=2))
        await pool.start()
        try:
            assert (await run_stateless(pool, "print(1)", 10)).stdout == "1\n"
            return [t for t in threading.enumerate() if isinstance(t, HBChannel) and t.is_alive()]
        finally:
            await pool.close()

    assert asyncio.run(go()) == []


def test_a_cancellation_that_arrives_as_the_awaited_work_finishes_is_not_lost():
    """A signal stops the command even when it lands in the loop turn in which a kernel became ready: Python
    3.11's wait_for would return the kernel and drop the cancellation. What was taken is handed back first."""
    from stare_sandbox.pool import _wait_for

    async def go() -> tuple[bool, list[int]]:
        ready = asyncio.get_running_loop().create_future()
        undone: list[int] = []
        waiter = asyncio.ensure_future(_wait_for(ready, 10, undone.append))
        await asyncio.sleep(0)  # the waiter now awaits `ready`
        ready.set_result(7)  # the work finishes ...
        waiter.cancel()  # ... in the same turn as the caller is cancelled
        try:
            await waiter
        except asyncio.CancelledError:
            return True, undone
        return False, undone

    assert asyncio.run(go()) == (True, [7])


# --- kernels started ahead of demand, a bounded number at once -----------------------------------------


def settled(pool: KernelPool, ready: int) -> bool:
    return pool.ready_count == ready and pool.starting_count == 0 and pool.alive_count == ready


async def wait_settled(pool: KernelPool, ready: int) -> None:
    """Until `ready` kernels are ready and nothing else is alive; the limit only stops a hung test."""
    deadline = time.monotonic() + 180
    while not settled(pool, ready):
        assert time.monotonic() < deadline, (
            f"ready {pool.ready_count}, starting {pool.starting_count}, alive {pool.alive_count}; wanted {ready} ready"
        )
        await asyncio.sleep(0.05)


def count_starts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts kernel starts under way in any KernelPool, by wrapping the one method that starts a kernel (a call
    starting its own kernel would go through it too), so the pool's own peak counter is checked, not trusted."""
    seen = {"now": 0, "peak": 0, "total": 0}
    start = KernelPool._start_kernel

    async def counted(self: KernelPool, *args: object) -> object:
        seen["now"] += 1
        seen["total"] += 1
        seen["peak"] = max(seen["peak"], seen["now"])
        try:
            return await start(self, *args)
        finally:
            seen["now"] -= 1

    monkeypatch.setattr(KernelPool, "_start_kernel", counted)
    return seen


@pytest.mark.slow
def test_a_burst_beyond_the_pool_queues_for_kernels_started_at_most_max_starting_at_once(monkeypatch):
    """Ten stateless calls on one warm kernel, each needing a fresh one (stateless_reuse 0): every call succeeds,
    and no more than max_starting kernels ever start at once, although ten calls wanted one at the same time."""
    starts = count_starts(monkeypatch)

    async def go() -> tuple[list, KernelPool]:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=16, max_starting=2, stateless_reuse=0))
        await pool.start()
        try:
            await wait_settled(pool, 1)
            results = await asyncio.gather(*(run_stateless(pool, f"print({i} * 3)", 30) for i in range(10)))
        finally:
            await pool.close()
        return results, pool

    results, pool = asyncio.run(go())
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * 3}\n") for i in range(10)]
    assert starts["total"] >= 10  # the burst needed 9 starts beyond the warm kernel: the bound was tested
    assert starts["peak"] == 2
    assert pool.starting_peak == 2  # what /healthz reports as kernels_starting_peak
    assert pool.kernels_started >= 10 and pool.start_failures == 0


@pytest.mark.slow
def test_the_pool_refills_to_its_target_in_the_background_after_a_burst():
    """After a burst that used up every kernel (each retires after one run), the pool is back at pool_size ready
    kernels with no further call, and no more than that: starts stop at the target."""

    async def go() -> tuple[int, int]:
        pool = KernelPool(PoolSettings(pool_size=3, max_kernels=16, max_starting=1, stateless_reuse=0))
        await pool.start()
        try:
            await wait_settled(pool, 3)
            results = await asyncio.gather(*(run_stateless(pool, "print('x')", 30) for _ in range(6)))
            assert [r.stdout for r in results] == ["x\n"] * 6
            await wait_settled(pool, 3)
            return pool.ready_count, pool.kernels_started
        finally:
            await pool.close()

    ready, started = asyncio.run(go())
    assert ready == 3
    assert started == 3 + 6  # the first 3, and one successor per retired kernel: none started beyond the target


def test_the_pool_shrinks_back_to_pool_size_after_a_burst_of_reusable_kernels(monkeypatch):
    """Kernels that serve many runs (stateless_reuse) come back after a reset; those a burst made start beyond
    pool_size retire then instead of staying ready (and alive) for good."""
    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)  # none retires by its own (random) limit here

    async def go() -> tuple[int, int]:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=8, max_starting=2, stateless_reuse=50))
        await pool.start()
        try:
            await wait_settled(pool, 1)
            # each call holds its kernel a while, so the others wait and kernels are started for them
            code = "import time; time.sleep(2); print({})"
            results = await asyncio.gather(*(run_stateless(pool, code.format(i), 30) for i in range(4)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
            deadline = time.monotonic() + 180  # only stops a hung test
            while pool.starting_count or pool._returning or pool.alive_count != pool.ready_count:
                assert time.monotonic() < deadline, "resets and retirements did not settle"
                await asyncio.sleep(0.05)
            assert dict(pool.retired_by_cause) == {"surplus": pool.kernels_started - 1}  # all came back but one
            return pool.ready_count, pool.kernels_started
        finally:
            await pool.close()

    ready, started = asyncio.run(go())
    assert started > 1  # the burst had kernels started beyond pool_size
    assert ready == 1


def test_a_pool_without_cgroups_never_probes_the_cgroup_tree(monkeypatch):
    def probe() -> None:
        raise AssertionError("the cgroup tree was probed although pool.cgroups is off")

    monkeypatch.setattr(isolation, "usable_cgroups", probe)
    monkeypatch.setattr(pool_module, "usable_cgroups", probe)

    async def go() -> tuple[KernelPool, RunResult]:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=2, cgroups=False, limits=Limits(call_cpu_s=5)))
        await pool.start()
        try:
            return pool, await run_stateless(pool, "print(1)", 30)
        finally:
            await pool.close()

    pool, result = asyncio.run(go())
    assert (result.status, result.stdout) == ("ok", "1\n") and pool.isolation.cgroup == ""


def test_closing_the_last_pool_of_a_cgroup_removes_its_cgroup_dir():
    cgroups = isolation.usable_cgroups()
    if cgroups is None:
        pytest.skip("kernels get no cgroups here")

    async def go() -> None:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=2))
        await pool.start()
        try:
            assert (await run_stateless(pool, "print(1)", 30)).stdout == "1\n"
            assert pool.isolation.cgroup == cgroups.version
        finally:
            await pool.close()

    asyncio.run(go())
    for directory in cgroups.dirs:  # kept only while other pools (other tests' servers) have kernel cgroups there
        assert not directory.exists() or any(e.is_dir() for e in directory.iterdir()), directory


def test_the_uid_range_is_given_up_even_when_a_clean_up_step_fails(monkeypatch):
    def fail(prefix: str) -> int:
        raise OSError("injected failure")

    monkeypatch.setattr(pool_module, "kill_processes_with_home", fail)

    async def go() -> Path:
        pool = KernelPool(PoolSettings(pool_size=0, max_kernels=2, isolation="process", cgroups=False))
        await pool.start()
        lock = pool._owner.path
        with pytest.raises(OSError, match="injected"):
            await pool.close()
        return lock

    assert not asyncio.run(go()).exists()


@pytest.mark.parametrize("clean_state", ["fork", "reset"])
def test_warm_up_and_reset_are_not_held_to_the_per_call_caps(monkeypatch, clean_state):
    """Without cgroups a call's CPU time is a scan of /proc: our own code (warm-up, reset) is not measured. The
    scratch dir is walked after a call in the kernel (reset); after a forked call the template reports what the
    worker left (tests/sandbox/test_isolation.py, the scratch quota), and there is nothing left to walk."""
    reads = {"cpu": 0, "scratch": 0}
    cpu, scratch = isolation.KernelMeter.cpu_seconds, isolation.KernelMeter.scratch_bytes

    def counted(kind: str, read):  # noqa: ANN001, ANN202
        def wrapper(self):  # noqa: ANN001, ANN202
            reads[kind] += 1
            return read(self)

        return wrapper

    monkeypatch.setattr(isolation.KernelMeter, "cpu_seconds", counted("cpu", cpu))
    monkeypatch.setattr(isolation.KernelMeter, "scratch_bytes", counted("scratch", scratch))

    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)  # the kernel is reset, not replaced

    async def go() -> tuple[dict, dict, dict]:
        limits = Limits(call_cpu_s=5, scratch_mb=64)
        pool = KernelPool(
            PoolSettings(
                pool_size=1, max_kernels=2, cgroups=False, stateless_reuse=50, limits=limits, clean_state=clean_state
            )
        )
        await pool.start()
        try:
            await wait_settled(pool, 1)
            warm = dict(reads)
            assert (await run_stateless(pool, "print(1)", 30)).stdout == "1\n"
            call = dict(reads)
            await wait_settled(pool, 1)  # reset, and ready again
            return warm, call, dict(reads)
        finally:
            await pool.close()

    warm, call, reset = asyncio.run(go())
    assert warm == {"cpu": 0, "scratch": 0}
    assert call["cpu"] >= 1  # the user's call is measured
    if clean_state == "reset":
        assert call["scratch"] >= 1
    else:
        assert call["scratch"] == 0  # the template's figure counts, with no walk of the emptied dir
    assert reset == call


def test_calls_waiting_for_a_kernel_get_an_error_at_once_when_the_pool_closes():
    async def go() -> BaseException:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=1, queue_wait_s=5))
        await pool.start()
        held = await pool.acquire(wait_s=120)  # the only kernel there may be (its start may be slow on a busy host)
        waiting = asyncio.ensure_future(pool.acquire())
        while pool.waiting_count < 1:
            await asyncio.sleep(0.01)
        await pool.close()
        assert held.closing
        with pytest.raises(SandboxError) as info:
            await waiting
        return info.value

    error = asyncio.run(go())
    assert not isinstance(error, KernelsBusy)  # not left to run out its queue_wait_s
    assert "closed while this call waited" in str(error)


@pytest.mark.parametrize(
    ("settings", "cause"),
    [
        ({"warmup_code": "raise ValueError('no warm-up')"}, "warmup"),
        ({"warmup_code": "import os; os._exit(3)"}, "died"),
        ({"startup_timeout_s": 0.01}, "timeout"),
    ],
)
def test_failed_kernel_starts_are_counted_by_cause(private_tmp, settings, cause):
    async def go() -> KernelPool:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=2, **settings))
        await pool.start()
        try:
            deadline = time.monotonic() + 120
            while pool.start_failures < 1:
                assert time.monotonic() < deadline, "no kernel start failed"
                await asyncio.sleep(0.05)
        finally:
            await pool.close()
        return pool

    pool = asyncio.run(go())
    assert set(pool.start_failures_by_cause) == {cause}
    assert pool.kernels_started == 0 and pool.ready_count == 0
    assert_nothing_left(private_tmp)


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"max_starting": -1}, "max_starting must be >= 0"), ({"queue_wait_s": 0}, "queue_wait_s must be > 0")],
)
def test_bad_supply_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        PoolSettings(**settings)


def test_a_stateless_call_that_gets_no_kernel_in_time_gets_503_with_retry_after_and_clients_retry():
    """The server's only kernel is held by a session: a stateless call waits queue_wait_s for a kernel, then gets
    503 with Retry-After (not a sandbox_error result, not a hang); the client retries such answers, and once
    the session is closed its call runs. /healthz and /metrics count the refusals."""
    from .test_service import Server  # the real server on a free loopback port

    srv = Server("--pool-size", "1", "--max-kernels", "1", "--max-starting", "1", "--queue-wait-s", "1").start()
    try:
        deadline = time.monotonic() + 180  # only stops a hung test: a kernel start is slow on a busy machine
        while httpx.get(f"{srv.url}/healthz").json()["pool_ready"] < 1:
            assert time.monotonic() < deadline, "the server's kernel never became ready"
            time.sleep(0.1)
        with SandboxClient(srv.url, retries=2, backoff_s=0.01) as client:
            session = client.create_session()  # holds the only kernel there may be
            refused = httpx.post(f"{srv.url}/v1/execute", json={"code": "print(1)"}, timeout=60)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "queue_wait_s=1" in refused.json()["detail"]
            health = client.health()
            assert (health["kernel_waits_refused"], health["kernel_waiting"], health["max_starting"]) == (1, 0, 1)
            with pytest.raises(SandboxUnavailable, match="HTTP 503"):
                client.execute("print(2)")
            refusals = client.health()["kernel_waits_refused"]
            assert refusals >= 1 + 2  # the client tried again after a 503
            metrics = httpx.get(f"{srv.url}/metrics").text
            assert f"sandbox_kernel_waits_refused_total {refusals:.1f}" in metrics
            assert f"sandbox_kernel_wait_seconds_count {refusals + 1:.1f}" in metrics  # and the session's wait
            assert 'sandbox_kernel_start_failures_total{cause="timeout"} 0.0' in metrics
            assert "sandbox_kernel_starts_total 1.0" in metrics and "sandbox_kernels_starting 0.0" in metrics
            assert 'sandbox_kernel_retirements_total{cause="session"} 0.0' in metrics
            client.close_session(session)
            assert client.health()["kernels_retired_by_cause"]["session"] == 0  # its kernel serves again
        with SandboxClient(srv.url, retries=30, backoff_s=0.2) as client:  # the kernel's reset may take a while here
            assert client.execute("print(3)").stdout == "3\n"
            assert client.health()["kernels_started"] == 1
    finally:
        srv.stop()


def test_the_in_process_client_waits_again_when_no_kernel_came_in_time():
    """In-process there is no 503 to retry: a call that got no kernel within queue_wait_s (its code never ran)
    waits again, up to busy_retries times, and only then is a sandbox_error."""

    async def main(busy_retries: int) -> RunResult:
        # no warm kernel and a wait far shorter than a kernel start: the first waits always time out
        settings = PoolSettings(pool_size=0, max_kernels=2, queue_wait_s=0.05)
        async with InProcessClient(settings, busy_retries=busy_retries) as client:
            return await client.execute("print(6 * 7)")

    patient = asyncio.run(main(busy_retries=1000))
    assert (patient.status, patient.stdout) == ("ok", "42\n")
    impatient = asyncio.run(main(busy_retries=0))
    assert impatient.status == "sandbox_error" and "queue_wait_s" in impatient.error.message


# --- dead kernels: never handed out, never signalled by a recycled id --------------------------------


async def kill_and_wait(kernel: Kernel) -> None:
    """SIGKILL the kernel's process (process isolation: the kernel itself) and wait until it has exited."""
    os.kill(kernel.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + DEATH_S
    while not kernel.exited():
        assert time.monotonic() < deadline, "the kernel did not die"
        await asyncio.sleep(0.01)


def test_a_ready_kernel_that_died_is_replaced_not_handed_out():
    """A warm kernel killed while it waits in the pool (the OOM killer, a SIGKILL) is retired when a call would
    take it, and the call runs on another kernel instead of failing with KernelDied: stateless and in a session."""

    async def go() -> list[tuple[str, str]]:
        pool = KernelPool(PoolSettings(pool_size=1, max_kernels=4, isolation="process"))
        sessions = SessionStore(pool, max_sessions=4, idle_s=600)
        await pool.start()

        async def in_a_session() -> RunResult:
            session = await sessions.create()
            assert (await sessions.execute(session, "x = 6", 30)).status == "ok"
            return await sessions.execute(session, "print(x * 7)", 30)

        results = []
        try:
            for call in (lambda: run_stateless(pool, "print(6 * 7)", 30), in_a_session):
                await wait_settled(pool, 1)
                await kill_and_wait(pool._ready[0])
                result = await call()
                results.append((result.status, result.stdout))
        finally:
            await sessions.close_all()
            await pool.close()
        return results

    assert asyncio.run(go()) == [("ok", "42\n"), ("ok", "42\n")]


DEEP_TREE = """\
import os
for depth in range(1500):
    os.mkdir("d")
    os.chdir("d")
print(depth + 1)
"""


@pytest.mark.parametrize(
    "clean_state, expected",
    [
        (
            "reset",
            [
                ({}, 1),  # lent and back: no start
                ({}, 1),
                ({"reused": 1}, 2),  # its last run: a successor
                ({"reused": 1, "died": 1, "session": 1}, 4),  # the session's two kernels each had a successor
                ({"reused": 1, "died": 1, "session": 1, "reset_failed": 1}, 5),
            ],
        ),
        (
            "fork",
            [
                ({}, 1),
                ({}, 1),
                ({"reused": 1}, 2),
                ({"reused": 1, "died": 1}, 3),  # the killed kernel had a successor; the session's second came back
                ({"reused": 1, "died": 1, "reset_failed": 1}, 4),
            ],
        ),
    ],
)
def test_retirements_are_counted_by_cause_and_a_lent_kernel_that_comes_back_has_no_successor(
    monkeypatch, clean_state, expected
):
    """Each way a kernel leaves a running pool is counted under its own cause (/healthz, /metrics): its reuse limit
    served, its death found after a call, a scratch dir that could not be emptied (a failed reset), its session
    closed (clean_state reset; with forked workers a closed session's kernel comes back instead). A stateless run
    that is not its kernel's last starts no successor (the kernel comes back): no start, no surplus retirement."""
    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)  # a kernel retires after exactly stateless_reuse runs

    async def go() -> list[tuple[dict[str, int], int]]:
        settings = PoolSettings(
            pool_size=1, max_kernels=4, isolation="process", stateless_reuse=3, clean_state=clean_state
        )
        pool = KernelPool(settings)
        sessions = SessionStore(pool, max_sessions=4, idle_s=600)
        await pool.start()
        seen = []

        def note() -> None:
            seen.append((dict(pool.retired_by_cause), pool.kernels_started))

        try:
            await wait_settled(pool, 1)
            for i in range(3):  # the same kernel three times, then it retires
                assert (await run_stateless(pool, f"print({i})", 30)).stdout == f"{i}\n"
                await wait_settled(pool, 1)
                note()
            session = await sessions.create()
            await kill_and_wait(sessions._sessions[session].kernel)
            assert (await sessions.execute(session, "print(2)", 30)).error.name == "KernelDied"
            assert (await sessions.execute(session, "print(3)", 30)).stdout == "3\n"  # on a new kernel
            await sessions.close(session)
            await wait_settled(pool, 1)
            note()
            # a tree deeper than the cleanup between runs can follow: its kernel must not serve again
            scratch = pool._ready[0].scratch
            assert (await run_stateless(pool, DEEP_TREE, 30)).stdout == "1500\n"
            await wait_settled(pool, 1)
            note()
            assert not scratch.exists()  # removed with its kernel, however deep
        finally:
            await pool.close()
        return seen

    assert asyncio.run(go()) == expected


@pytest.mark.parametrize("clean_state", ["reset", "fork"])
def test_a_call_waiting_on_a_pool_whose_kernel_is_being_reset_gets_that_kernel_and_starts_none(
    monkeypatch, clean_state
):
    """Every kernel lent (pool_size 1, one call ran): a call that comes while the kernel is being reset (with fork:
    given back) waits for it, and no kernel starts on its account (one did, and then came back to stay or retired
    as surplus)."""
    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)

    worker = "call" if clean_state == "fork" else None

    async def go() -> tuple[int, int, int, int, dict[str, int]]:
        pool = KernelPool(
            PoolSettings(pool_size=1, max_kernels=4, isolation="process", stateless_reuse=10, clean_state=clean_state)
        )
        await pool.start()
        try:
            await wait_settled(pool, 1)
            first = await pool.acquire(stateless=True)
            first.runs += 1
            assert (await first.execute("x = 1", 30, pool.settings, worker=worker)).status == "ok"
            pool.give_back_later(first)  # its reset starts in the background: the kernel is coming back
            second = await pool.acquire(stateless=True)  # waits: no kernel is ready
            starting = pool._starting
            second.runs += 1
            result = await second.execute("print(globals().get('x'))", 30, pool.settings, worker=worker)
            pool.give_back_later(second)
            await wait_settled(pool, 1)
            assert result.stdout == "None\n"  # reset in between
            return (
                second.slot - first.slot,
                starting,
                pool.kernels_started,
                pool.alive_count,
                dict(pool.retired_by_cause),
            )
        finally:
            await pool.close()

    same, starting, started, alive, retired = asyncio.run(go())
    assert (same, starting, started, alive) == (0, 0, 1, 1), "a kernel started for a call that a reset served"
    assert retired.get("surplus", 0) == 0


@pytest.mark.parametrize("reuse", [10_000, 5])
def test_a_saturated_pool_serves_a_steady_stateless_load_with_the_kernels_it_has(monkeypatch, reuse):
    """More callers than calls allowed to run (8 tasks, max_running 2 = pool_size): every kernel is lent or being
    reset, calls keep waiting for one, and the pool's kernels serve them all. A kernel starts only to succeed one
    that served its `reuse` runs, and none retires as surplus. (A call waiting for a reset, a kernel handed to a
    call not yet resumed, and a call waiting while a successor starts each started one more.)"""
    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)  # each kernel retires after exactly `reuse` runs

    async def go() -> tuple[int, dict[str, int], list[str]]:
        settings = PoolSettings(pool_size=2, max_kernels=8, isolation="process", stateless_reuse=reuse)
        client = InProcessClient(settings, max_running=2)
        await client.start()
        pool = client.pool
        try:
            await wait_settled(pool, 2)
            started = pool.kernels_started

            async def caller(i: int) -> list[str]:
                return [(await client.execute(f"print({i * 100 + j})")).stdout for j in range(8)]

            printed = [out for outs in await asyncio.gather(*(caller(i) for i in range(8))) for out in outs]
            await wait_settled(pool, 2)
            return pool.kernels_started - started, dict(pool.retired_by_cause), printed
        finally:
            await client.close()

    starts, retired, printed = asyncio.run(go())
    assert printed == [f"{i * 100 + j}\n" for i in range(8) for j in range(8)]
    assert retired.get("surplus", 0) == 0 and starts == retired.get("reused", 0), f"{starts} starts, retired {retired}"
    assert starts == (64 // reuse if reuse < 64 else 0)


def test_a_dead_kernels_group_is_signalled_only_while_its_id_cannot_be_reused(monkeypatch):
    """A kernel's process group id is that of its first process, free for a new process once that one is reaped.
    Stopping a kernel that died signals its group while the process is unreaped (what it started dies with it),
    and sends nothing once jupyter_client reaped it (its is_alive() does, e.g. while a kernel starts)."""
    ids: dict[str, int] = {}
    signalled: list[tuple[int, int]] = []
    real_killpg = os.killpg

    def killpg(pgid: int, signum: int) -> None:
        if pgid in ids.values():
            signalled.append((pgid, signum))
        if pgid == ids.get("reaped"):  # never signal it for real: a new process may hold the id by now
            raise ProcessLookupError(pgid)
        real_killpg(pgid, signum)

    monkeypatch.setattr(os, "killpg", killpg)

    async def go() -> dict[int, int]:
        pool = KernelPool(PoolSettings(pool_size=2, max_kernels=4, isolation="process"))
        await pool.start()
        try:
            await wait_settled(pool, 2)
            unreaped, reaped = await pool.acquire(), await pool.acquire()
            # a process the kernel started, in its process group: only a signal to the group ends it
            code = "import subprocess; print(subprocess.Popen(['sleep', '600']).pid)"
            child = int((await unreaped.execute(code, 30, pool.settings)).stdout)
            started = {child: _stat(child)[2]}
            ids.update(unreaped=unreaped.process.pid, reaped=reaped.process.pid)
            for kernel in (unreaped, reaped):
                await kill_and_wait(kernel)
            reaped.process.poll()  # reaps it, as jupyter_client's is_alive() does
            await pool.discard(unreaped)
            await pool.discard(reaped)
            return started
        finally:
            await pool.close()

    started = asyncio.run(go())
    left = wait_until_gone(started, DEATH_S)[0]
    kill_all(started)
    assert [signum for pgid, signum in signalled if pgid == ids["reaped"]] == []
    assert (ids["unreaped"], signal.SIGKILL) in signalled
    assert left == []


def test_kernels_reuse_limits_spread_over_the_whole_range():
    """Each kernel's limit of stateless runs is its own draw from [1, n]: kernels started together (a pool's first
    ones) then retire at times spread over a kernel's whole life, not within a few seconds of each other."""
    limits = [pool_module.reuse_limit(100) for _ in range(2000)]
    assert min(limits) >= 1 and max(limits) <= 100
    assert sum(limit <= 25 for limit in limits) > 300  # about a quarter; none with draws from [n/2, n]
    assert sum(limit > 75 for limit in limits) > 300
    assert pool_module.reuse_limit(0) == 0  # a fresh kernel every run
