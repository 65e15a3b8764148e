"""When one of a forking kernel's processes dies (the template, the spare worker, a worker, the kernel's relay):
no call answers `ok` without the report of the worker that ran it, a kernel that cannot serve is retired before
another call lands on it, and the other sessions and stateless calls go on as if nothing happened.

Real kernels (`pool.clean_state: fork`, numpy and sympy warm), real signals: sent by the code a call runs (a worker
killing its parent, the template) or from outside the kernel (this test process, as the OOM killer would). A pool
of one kernel whose stateless runs all reuse it, so every later call would land on the broken kernel if the pool
kept it. Every call whose output is known is checked: `ok` with exactly that output, or a `sandbox_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from procs import REPO, _stat, forking_kernel, stop_service  # tests/procs.py

from stare_sandbox import pool as pool_module
from stare_sandbox.kernel import Kernel
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.schemas import RunResult
from stare_sandbox.sessions import SessionStore, run_stateless

from .test_service import free_port


def kill_parent(sig: str, *, finish: bool) -> str:
    """Code that kills its worker's parent (the template). `finish`: then it ends at once, so its worker may report
    before it dies with the template; else it sleeps first, so it dies before it can report."""
    rest = "" if finish else "import time; time.sleep(1); print('after')\n"
    return f"import os, signal\nprint('before', flush=True)\nos.kill(os.getppid(), signal.{sig})\n{rest}"


KILL_KERNEL = """
import os, signal, time
kernel = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])  # the template's parent
os.kill(kernel, signal.SIGKILL)
time.sleep(1)
print("after")
"""

FORGE_REPORT = """
import json, os, socket, time
report = json.dumps({"done": True, "call": "forged", "error": None, "displays": []}).encode()
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            continue
        link = socket.socket(fileno=os.dup(fd))
    except OSError:
        continue
    if link.family == socket.AF_UNIX and link.type == socket.SOCK_STREAM:  # the worker's socket to the kernel
        link.sendall(len(report).to_bytes(8, "big") + report)
time.sleep(0.5)
print("real output")
"""


@pytest.fixture
def one_kernel(monkeypatch: pytest.MonkeyPatch) -> PoolSettings:
    """A pool of one kernel whose stateless runs all reuse it (no retirement drawn)."""
    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)
    return PoolSettings(pool_size=1, max_kernels=1, stateless_reuse=100)


def only_kernel(pool: KernelPool) -> Kernel:
    (kernel,) = pool._kernels
    return kernel


async def run_script(settings: PoolSettings, steps: list[tuple]) -> tuple[list[RunResult | None], KernelPool]:
    """Run steps in order on a new pool: ("stateless", code), ("session", name, code), ("close", name), ("sleep",
    seconds), or ("kill", process, signal, delay_s), sent from this process to the pool's kernel (process: template,
    spare, relay) `delay_s` after the call before it began, while it runs (0: after it ended). The results, one per
    step (None for those that are not calls), and the pool, closed."""
    pool = KernelPool(settings)
    await pool.start()
    store = SessionStore(pool, max_sessions=4, idle_s=600)
    sessions: dict[str, str] = {}
    results: list[RunResult | None] = []
    running: asyncio.Task | None = None
    try:
        for step in steps:
            if step[0] == "kill":
                _, which, sig, delay = step
                if running is not None and not delay:
                    results.append(await running)
                    running = None
                await asyncio.sleep(delay)
                await asyncio.to_thread(kill_from_outside, pool, which, sig)
                if running is not None:
                    results.append(await running)
                    running = None
                results.append(None)
                continue
            if running is not None:
                results.append(await running)
                running = None
            if step[0] == "sleep":
                await asyncio.sleep(step[1])
                results.append(None)
                continue
            if step[0] == "close":
                await store.close(sessions.pop(step[1]))
                results.append(None)
                continue
            if step[0] == "stateless":
                call = run_stateless(pool, step[1], 30)
            else:
                if step[1] not in sessions:
                    sessions[step[1]] = await store.create()
                call = store.execute(sessions[step[1]], step[2], 30)
            running = asyncio.ensure_future(call)
        if running is not None:
            results.append(await running)
        return results, pool
    finally:
        if running is not None and not running.done():
            running.cancel()
        await pool.close()


def kill_from_outside(pool: KernelPool, which: str, sig: str) -> None:
    """Signal one process of the pool's only kernel, waiting first (up to 10 s) until it exists; a spare, until its
    template has reaped it (a call handed the spare while its kill was still under way gets a sandbox_error, as any
    call whose worker dies: docs/sandbox.md)."""
    deadline = time.monotonic() + 10
    while True:
        kernel = only_kernel(pool)
        assert kernel.process is not None
        found = forking_kernel(kernel.process.pid)
        if which.startswith("spare"):
            pids = found["children"]  # while no call runs, the template's only child is the spare
        else:
            pids = found[which]
        if len(pids) == 1:
            break
        assert time.monotonic() < deadline, f"no single {which} process: {found}"
        time.sleep(0.05)
    os.kill(pids[0], getattr(signal, sig))
    while which == "spare" and _stat(pids[0]) is not None:  # until the template has reaped it
        assert time.monotonic() < deadline, f"the spare {pids[0]} was not reaped"
        time.sleep(0.01)


def run(settings: PoolSettings, steps: list[tuple]) -> tuple[list[RunResult | None], KernelPool]:
    return asyncio.run(run_script(settings, steps))


def exact_or_sandbox_error(result: RunResult, stdout: str) -> bool:
    return result.status == "sandbox_error" or (result.status == "ok" and result.stdout == stdout)


def exact(result: RunResult, stdout: str) -> bool:
    return result.status == "ok" and result.stdout == stdout


AFTER_STATELESS = [("stateless", f"print({n})") for n in (100, 101, 102)]
AFTER_SESSION = [("session", "b", f"print({n} * 7)") for n in range(3)]


def check_the_others(results: list[RunResult | None], steps: list[tuple]) -> None:
    """The steps of AFTER_STATELESS and AFTER_SESSION got exactly their output: no call landed on the broken
    kernel, and none lost anything."""
    for step, result in zip(steps, results, strict=True):
        if step in AFTER_STATELESS:
            assert exact(result, f"{step[1][6:-1]}\n"), (step, result)
        elif step in AFTER_SESSION:
            assert exact(result, f"{eval(step[2][6:-1])}\n"), (step, result)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("finish", [False, True], ids=["dies-first", "may-finish"])
def test_a_stateless_call_that_kills_its_template(one_kernel, sig, finish):
    steps = [("stateless", "print(1)"), ("stateless", kill_parent(sig, finish=finish))]
    steps += [*AFTER_STATELESS, *AFTER_SESSION, ("close", "b"), ("stateless", "print(103)")]
    results, pool = run(one_kernel, steps)
    assert exact(results[0], "1\n")
    killer = results[1]
    if finish:  # it ran to its end: its own output, or an explicit error
        assert exact_or_sandbox_error(killer, "before\n"), killer
    else:  # its worker died with the template before it finished: never an ok
        assert killer.status == "sandbox_error" and killer.error.name == "KernelFailed", killer
        assert killer.stdout == "before\n"  # what it printed before is kept
    check_the_others(results, steps)
    assert exact(results[-1], "103\n")
    assert pool.retired_by_cause["died"] >= 1  # the broken kernel (the exact results say no call landed on it)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("finish", [False, True], ids=["dies-first", "may-finish"])
def test_a_session_call_that_kills_its_template(one_kernel, sig, finish):
    steps = [("session", "a", "x = 6"), ("session", "a", kill_parent(sig, finish=finish))]
    steps += [("session", "a", "print('still here')"), ("close", "a"), *AFTER_SESSION, ("close", "b")]
    steps += AFTER_STATELESS
    results, pool = run(one_kernel, steps)
    assert exact(results[0], "")
    killer, still = results[1], results[2]
    if finish:
        assert exact_or_sandbox_error(killer, "before\n"), killer
    else:
        assert killer.status == "sandbox_error" and killer.stdout == "before\n", killer
    # The session's worker died with its template: its next call is an explicit error, or runs in a new interpreter
    # after one (the session was told its variables are lost), and is never an empty ok.
    assert exact_or_sandbox_error(still, "still here\n"), still
    assert killer.status == "sandbox_error" or still.status == "sandbox_error"
    check_the_others(results, steps)
    assert pool.retired_by_cause["died"] >= 1


@pytest.mark.parametrize("mode", ["stateless", "session"])
def test_a_call_that_kills_its_kernel(one_kernel, mode):
    """The relay (the kernel process) dies: the template and the worker die with it; the call is a sandbox_error."""
    call = ("stateless", KILL_KERNEL) if mode == "stateless" else ("session", "a", KILL_KERNEL)
    steps = [call, *AFTER_STATELESS, *AFTER_SESSION] if mode == "stateless" else [call, *AFTER_SESSION]
    results, pool = run(one_kernel, steps)
    assert results[0].status == "sandbox_error" and results[0].error.name == "KernelDied", results[0]
    check_the_others(results, steps)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("spare", ["spare", "spare-at-once"], ids=["reaped", "at-once"])
def test_a_spare_worker_killed_from_outside_costs_no_call(one_kernel, sig, spare):
    """The spare (forked ahead, waiting for its call) dies: the template forks another when the next call comes;
    the kernel serves on, with every result exact. Killed as the next call comes, it may be handed that call and
    die before it begins the code: the call then runs once more."""
    steps = [("stateless", "print(1)"), ("kill", spare, sig, 0), *AFTER_STATELESS, *AFTER_SESSION]
    steps += [("close", "b"), ("kill", spare, sig, 0), ("stateless", "print(104)")]
    results, pool = run(one_kernel, steps)
    assert exact(results[0], "1\n") and exact(results[-1], "104\n")
    check_the_others(results, steps)
    assert pool.calls_rerun <= (spare == "spare-at-once") * 2


@pytest.mark.parametrize("wait_s", [0.0, 2.0], ids=["at-once", "after-2s"])
def test_a_template_killed_from_outside_while_its_kernel_waits(one_kernel, wait_s):
    """As the OOM killer would, while the kernel is ready: no call is lost. The kernel exits (the pool replaces it
    before handing it out), or the call that finds it first runs again on a new kernel, its code never having run."""
    steps = [("stateless", "print(1)"), ("kill", "template", "SIGKILL", 0), ("sleep", wait_s)]
    steps += [*AFTER_STATELESS, *AFTER_SESSION]
    results, pool = run(one_kernel, steps)
    check_the_others(results, steps)
    assert pool.retired_by_cause["died"] >= 1


def test_a_template_killed_from_outside_under_an_idle_session(one_kernel):
    """The session's worker dies with its template. Its next calls print x while the worker lives (one not dead yet
    may run a call to its end), then one is a sandbox_error saying the variables are lost, and only after that do
    calls run in a new interpreter, without x: never a call that silently lost it."""
    probe = "print(globals().get('x', 'lost'))"
    steps = [("session", "a", "x = 6"), ("kill", "template", "SIGKILL", 0)]
    steps += [("session", "a", probe)] * 3 + [("close", "a"), *AFTER_SESSION, ("close", "b"), *AFTER_STATELESS]
    results, pool = run(one_kernel, steps)
    seen = ["error" if r.status == "sandbox_error" else (r.status, r.stdout) for r in results[2:5]]
    assert seen in (["error", ("ok", "lost\n"), ("ok", "lost\n")], [("ok", "6\n"), "error", ("ok", "lost\n")]), seen
    lost = next(r for r in results[2:5] if r.status == "sandbox_error")
    assert lost.error.name in ("KernelDied", "KernelFailed") and "variables are lost" in lost.error.message
    check_the_others(results, steps)


def test_a_template_killed_from_outside_during_a_call(one_kernel):
    slow = "import time\nprint('a', flush=True)\ntime.sleep(3)\nprint('b')\n"
    steps = [("session", "a", slow), ("kill", "template", "SIGKILL", 1.0), ("session", "a", "print('again')")]
    steps += [("close", "a"), *AFTER_SESSION, ("close", "b"), *AFTER_STATELESS]
    results, pool = run(one_kernel, steps)
    assert results[0].status == "sandbox_error" and results[0].stdout == "a\n", results[0]
    assert exact(results[2], "again\n")
    check_the_others(results, steps)


def test_a_report_that_is_not_the_calls_own_is_refused(one_kernel):
    """A worker's report must carry its call's id: one forged by the code (it writes a report on its own socket
    before it is done) is a sandbox_error, not an ok without the output that came after it."""
    steps = [("session", "a", FORGE_REPORT), ("session", "a", "print('again')"), ("close", "a"), *AFTER_STATELESS]
    results, pool = run(one_kernel, steps)
    forged = results[0]
    assert forged.status == "sandbox_error" and forged.error.name == "KernelFailed", forged
    assert "not this call's" in forged.error.message
    assert exact(results[1], "again\n")
    check_the_others(results, steps)


def test_an_answer_without_the_workers_report_is_a_sandbox_error(one_kernel):
    """A kernel that answers a worker call itself, with no worker behind it (here: a plain ipykernel, which ignores
    the request's worker metadata), gives no confirmation: the pool takes that as a failure, never as an ok."""

    async def go() -> tuple[RunResult, bool]:
        pool = KernelPool(dataclasses.replace(one_kernel, clean_state="reset"))
        await pool.start()
        try:
            kernel = await pool.acquire()
            result = await kernel.execute("print(5)", 30, pool.settings, worker="call")
            return result, kernel.dead
        finally:
            await pool.close()

    result, dead = asyncio.run(go())
    assert result.status == "sandbox_error" and result.error.name == "KernelFailed" and dead, result
    assert "without its worker's report" in result.error.message


# --- under load: the deaths above mixed into 32 concurrent sessions of 20 calls, over the HTTP service ---------------

LOAD_SESSIONS = 32
LOAD_CALLS = 20
HOSTILE = {
    "template-sigkill": kill_parent("SIGKILL", finish=False),
    "template-sigterm": kill_parent("SIGTERM", finish=False),
    "template-finishing": kill_parent("SIGKILL", finish=True),
    "kernel": KILL_KERNEL,
    "forged-report": FORGE_REPORT,
}
HOSTILE_OUTPUT = {"template-finishing": "before\n", "forged-report": "real output\n"}
"""The output a hostile call may come back `ok` with (it ran to its end); the others can only fail."""
OUTSIDE_KILLS = 6
"""Templates SIGKILLed from outside, at random, while the sessions run (as the OOM killer would)."""


@dataclasses.dataclass
class LoadTally:
    calls: int = 0
    wrong: list = dataclasses.field(default_factory=list)
    """(where, expected, result) of every result that is neither exactly right nor a sandbox_error."""
    errors: int = 0
    """sandbox_errors of calls that were not hostile."""
    hostile: int = 0
    hostile_finished: int = 0
    """Hostile calls that came back ok: the session's worker may be gone, and its next call fail."""
    outside_kills: int = 0


def hostile_at(session: int, step: int) -> str | None:
    """Every fourth session makes one hostile call, at a step of its own, of each kind in turn."""
    if session % 4 or step != 2 + session * 7 % (LOAD_CALLS - 3):
        return None
    return list(HOSTILE)[session // 4 % len(HOSTILE)]


async def load_session(client, index: int, tally: LoadTally) -> None:
    """x = index; then per step x = 7 * x + step, printed; a stateless call every fifth step; hostile calls where
    hostile_at says. After a sandbox_error the session (now in a clean interpreter) is given x again."""

    async def call(code: str, session: str | None, expected: str, where: str) -> bool:
        result = await client.execute(code, session, 30)
        tally.calls += 1
        if result.status == "sandbox_error":
            tally.errors += 1
            return False
        if result.status != "ok" or result.stdout != expected:
            tally.wrong.append((where, expected, result))
        return True

    session = await client.create_session()
    x = index
    while not await call(f"x = {x}", session, "", f"session {index} start"):
        pass
    for step in range(1, LOAD_CALLS + 1):
        kind = hostile_at(index, step)
        if kind is not None:
            tally.hostile += 1
            result = await client.execute(HOSTILE[kind], session, 30)
            if result.status == "ok":
                tally.hostile_finished += 1
                if result.stdout != HOSTILE_OUTPUT.get(kind):
                    tally.wrong.append((f"session {index} hostile {kind}", HOSTILE_OUTPUT.get(kind), result))
            elif result.status != "sandbox_error":
                tally.wrong.append((f"session {index} hostile {kind}", "ok or sandbox_error", result))
            while not await call(f"x = {x}", session, "", f"session {index} restore"):
                pass
        if step % 5 == 0:
            value = index * 1000 + step
            await call(f"print({value})", None, f"{value}\n", f"stateless {index}/{step}")
        while not await call(f"x = 7 * x + {step}\nprint(x)", session, f"{7 * x + step}\n", f"{index}/{step}"):
            while not await call(f"x = {x}", session, "", f"session {index} restore"):
                pass
        x = 7 * x + step
    await client.close_session(session)


async def kill_templates_meanwhile(server_pid: int, tally: LoadTally, stop: asyncio.Event) -> None:
    rng = random.Random(0)
    while tally.outside_kills < OUTSIDE_KILLS and not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.5)
        templates = (await asyncio.to_thread(forking_kernel, server_pid))["template"]
        if templates and not stop.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(templates), signal.SIGKILL)
                tally.outside_kills += 1


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "the service did not start"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)


@pytest.mark.slow
def test_32_sessions_of_20_calls_with_deaths_mixed_in_get_no_silent_wrong_result(tmp_path):
    """Over the real HTTP service: every result of a call whose output is known is exactly right or an explicit
    sandbox_error, and no more of those than the kernels the hostile calls and the outside kills broke."""
    from stare_sandbox.client import AsyncSandboxClient

    port = free_port()
    argv = [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(port), "--pool-size", "4"]
    argv += ["--max-kernels", "48", "--max-sessions", "40", "--max-running", "8", "--max-waiting", "256"]
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    tally = LoadTally()

    async def go() -> dict:
        async with AsyncSandboxClient(url, retries=8, timeout_s=120) as client:
            stop = asyncio.Event()
            killer = asyncio.ensure_future(kill_templates_meanwhile(server.pid, tally, stop))
            try:
                await asyncio.gather(*(load_session(client, i, tally) for i in range(LOAD_SESSIONS)))
            finally:
                stop.set()
                await killer
            # Afterwards the service is whole: one more round of calls, all exact.
            values = [await client.execute(f"print({n})", None, 30) for n in range(8)]
            assert [(r.status, r.stdout) for r in values] == [("ok", f"{n}\n") for n in range(8)]
            return await client.health()

    try:
        wait_healthy(url, server)
        health = asyncio.run(go())
    finally:
        stop_service(server)
    assert tally.wrong == [], tally.wrong[:5]
    assert tally.hostile == LOAD_SESSIONS // 4 and tally.calls > LOAD_SESSIONS * LOAD_CALLS
    assert tally.errors <= tally.outside_kills + tally.hostile_finished, tally
    assert health["kernels_retired_by_cause"]["died"] >= tally.hostile - tally.hostile_finished


def test_the_same_under_process_isolation(one_kernel):
    """Without namespaces (no PID namespace, no init: the kernel is the pool's child itself): a session call that
    kills its template, then a template killed from outside while the kernel waits; the others are exact."""
    settings = dataclasses.replace(one_kernel, isolation="process", cgroups=False)
    steps = [("session", "a", kill_parent("SIGKILL", finish=False)), ("session", "a", "print('again')")]
    steps += [("close", "a"), ("stateless", "print(1)"), ("kill", "template", "SIGKILL", 0), *AFTER_STATELESS]
    steps += [*AFTER_SESSION, ("close", "b")]
    results, pool = run(settings, steps)
    assert results[0].status == "sandbox_error" and results[0].error.name == "KernelFailed", results[0]
    assert exact(results[1], "again\n") and exact(results[3], "1\n")
    check_the_others(results, steps)
    assert pool.retired_by_cause["died"] >= 2
