"""Kernels end with their owner: the parent-death signal, KernelPool.close in every state, the exit fallback.

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

import pytest
from procs import _stat, alive, cmdline, descendants, processes_tied_to  # tests/procs.py

from sandbox.client import InProcessClient
from sandbox.isolation import _PDEATHSIG_EXEC, _setpriv_with_pdeathsig, detect_isolation
from sandbox.kernels import KernelPool, PoolSettings, run_stateless

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
import sandbox.isolation as isolation
if sys.argv[1] == "python":
    isolation._setpriv_with_pdeathsig = lambda: None
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
child = subprocess.Popen([*isolation._die_with_parent(sys.executable), *sleeper], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("prefix", ["setpriv", "python"])
def test_parent_death_prefix_kills_the_child_when_its_starter_dies(prefix):
    if prefix == "setpriv" and _setpriv_with_pdeathsig() is None:
        pytest.skip("no util-linux setpriv with --pdeathsig here")
    owner = subprocess.Popen([sys.executable, "-c", PREFIX_OWNER, prefix], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = {}
    try:
        pid = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        while "sleep(600)" not in cmdline(pid):  # the python fallback execs the program after its prctl
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
from sandbox.client import InProcessClient
from sandbox.kernels import PoolSettings

async def main(root: Path, isolation: str, ready: Path) -> None:
    settings = PoolSettings(pool_size=2, max_kernels=8, isolation=isolation, scratch_root=str(root))
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
from sandbox.kernels import KernelPool, PoolSettings, run_stateless

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
    from sandbox.kernels import _wait_for

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
