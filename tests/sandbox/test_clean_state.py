"""Leak probes: what one run leaves in an interpreter must not reach the next stateless run or the next session.

Every probe changes one kind of interpreter state (one leaves a child process running) in one call and is checked
from the next, on a pool of one kernel, so the next call gets the same interpreter or its successor. The baseline of
each check comes from a call made before any probe ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from stare_sandbox import pool as pool_module
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.sessions import SessionStore, run_stateless

PATCH = """
import atexit, builtins, math, os, signal, sys, threading, time
import sympy
math.pi = 3                                      # module attribute
sys.setrecursionlimit(60)                        # interpreter setting
builtins.leaked_name = 1                         # builtins
os.environ["LEAKED_VARIABLE"] = "1"              # environment
os.makedirs("sub", exist_ok=True); os.chdir("sub")  # working directory
leaked_fd = os.open("/dev/null", os.O_RDONLY)    # an open file no Python object holds
threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="leaked").start()  # a thread
atexit.register(print, "leaked at exit")        # an exit handler
signal.signal(signal.SIGUSR1, lambda *a: None)   # a signal handler
sympy.isprime = lambda n: True                   # a library function
import subprocess; subprocess.Popen(["sleep", "4243.7"])  # a child process left running
home = os.environ["HOME"]                        # files in the scratch dir, one in a dir made read-only
open(f"{home}/leaked.txt", "w").close(); os.makedirs(f"{home}/locked/in"); os.chmod(f"{home}/locked", 0o500)
def write_on(path=f"{home}/written-late.txt", sleep=time.sleep):  # and a thread that writes one while it runs
    while True:                                  # (its names bound here: the reset pool deletes the globals)
        open(path, "w").close(); sleep(0.001)
threading.Thread(target=write_on, daemon=True).start()
print("patched")
"""

CHECK = """
import atexit, builtins, json, math, os, signal, sys, threading
import sympy
from stare_sandbox.isolation import KERNEL_FILES
print(json.dumps({
    "module_attribute": math.pi,
    "recursion_limit": sys.getrecursionlimit(),
    "builtins": hasattr(builtins, "leaked_name"),
    "environment": "LEAKED_VARIABLE" in os.environ,
    "working_directory": os.getcwd() == os.environ["HOME"],
    "open_files": len(os.listdir("/proc/self/fd")),
    "threads": sorted(t.name for t in threading.enumerate() if t.name == "leaked"),
    "atexit_handlers": atexit._ncallbacks(),
    "signal_handler": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
    "library_function": sympy.isprime(4),
    "child_process": sum(
        "4243.7" in open(f"/proc/{p}/cmdline").read() for p in os.listdir("/proc") if p.isdigit()
        and os.path.exists(f"/proc/{p}/cmdline")
    ),
    "scratch_files": sorted(n for n in os.listdir(os.environ["HOME"]) if not n.startswith(KERNEL_FILES)),
}))
"""


def _state(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _leaks(before: dict, after: dict) -> dict:
    return {probe: (before[probe], after[probe]) for probe in before if before[probe] != after[probe]}


@pytest.fixture
def one_kernel_pool(monkeypatch: pytest.MonkeyPatch):
    """Settings of a pool of one kernel whose stateless runs reuse it (no retirement drawn before the probes)."""
    monkeypatch.setattr(pool_module, "reuse_limit", lambda n: n)
    return PoolSettings(pool_size=1, max_kernels=1, stateless_reuse=100)


def _stateless(settings: PoolSettings, codes: tuple[str, ...]) -> list:
    """The results of `codes` run in turn as stateless calls on a pool of `settings`."""

    async def go() -> list:
        pool = KernelPool(settings)
        await pool.start()
        try:
            return [await run_stateless(pool, code, 30) for code in codes]
        finally:
            await pool.close()

    return asyncio.run(go())


def test_a_stateless_run_starts_from_the_state_the_one_before_found(one_kernel_pool):
    before, patched, after = _stateless(one_kernel_pool, (CHECK, PATCH, CHECK))
    assert patched.stdout == "patched\n"
    assert _leaks(_state(before.stdout), _state(after.stdout)) == {}


def test_every_probe_but_the_working_directory_leaks_through_the_reset_pool(one_kernel_pool):
    """clean_state reset (the pool before forked workers, kept as a baseline) wipes the user namespace, goes back
    to the scratch dir and empties it after a run, nothing else: the probes find each other kind of state it leaves
    (files too: the probe's thread writes one again after the reset)."""
    settings = dataclasses.replace(one_kernel_pool, clean_state="reset")
    before, patched, after = _stateless(settings, (CHECK, PATCH, CHECK))
    assert patched.stdout == "patched\n"
    before, after = _state(before.stdout), _state(after.stdout)
    assert set(_leaks(before, after)) == set(before) - {"working_directory"}
    assert after["scratch_files"] == ["written-late.txt"]  # emptied, but the thread lives on in the kernel


def _in_sessions(settings: PoolSettings, codes: tuple[str, ...], *, one_session: bool) -> tuple[list, int]:
    """The results of `codes` run in turn in one session, or each in a new session, on a pool of `settings`; and
    how many kernels the pool started."""

    async def go() -> tuple[list, int]:
        pool = KernelPool(settings)
        await pool.start()
        sessions = SessionStore(pool, max_sessions=1, idle_s=600)
        results, session = [], None
        try:
            for code in codes:
                if session is None or not one_session:
                    session = await sessions.create()
                results.append(await sessions.execute(session, code, 30))
                if not one_session:
                    assert await sessions.close(session)
        finally:
            await pool.close()
        return results, pool.kernels_started

    return asyncio.run(go())


def test_a_new_session_starts_from_the_state_the_one_before_found(one_kernel_pool):
    (before, patched, after), started = _in_sessions(one_kernel_pool, (CHECK, PATCH, CHECK), one_session=False)
    assert patched.stdout == "patched\n"
    assert _leaks(_state(before.stdout), _state(after.stdout)) == {}
    assert started == 1  # each closed session's kernel served the next: a new session needs no kernel start


def test_workers_are_forked_from_a_template_with_one_thread(one_kernel_pool):
    """Every call runs in its own process, a child of the template, which has a single thread when it forks."""
    code = "import os\nprint(os.getpid(), os.getppid(), len(os.listdir(f'/proc/{os.getppid()}/task')))"
    first, second = (result.stdout.split() for result in _stateless(one_kernel_pool, (code, code)))
    assert first[0] != second[0] and first[1] == second[1]  # two workers, one template
    assert first[2] == second[2] == "1"


def test_the_probes_do_change_the_state_they_probe(one_kernel_pool):
    """Within one session every probe's change is seen: a probe that changed nothing could not find a leak."""
    (before, patched, after), _ = _in_sessions(one_kernel_pool, (CHECK, PATCH, CHECK), one_session=True)
    assert patched.stdout == "patched\n"
    before, after = _state(before.stdout), _state(after.stdout)
    assert set(_leaks(before, after)) == set(before)


# --- the warm pages: what every worker would copy on write, copied by its spare while it waits ---------------------

COPY_AHEAD = """
import ctypes, mmap, os, socket, sys
from stare_sandbox.template import copy_ahead, own_pages
page = os.sysconf("SC_PAGE_SIZE")
area = mmap.mmap(-1, 64 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
area[:] = bytes(range(256)) * (64 * page // 256)  # every page present, and shared with the child after the fork
start = ctypes.addressof(ctypes.c_char.from_buffer(area))
waiting, ready = socket.socketpair()
if sys.argv[1] == "interrupted":
    ready.send(b"x")
pid = os.fork()
if pid == 0:
    copy_ahead([(start + 8 * page, 16 * page), (start + 40 * page, page)], interrupt=waiting)
    copied = own_pages("/proc/self/pagemap", [(start, start + 64 * page)])
    unchanged = area[:] == bytes(range(256)) * (64 * page // 256)
    print([((address - start) // page, length // page) for address, length in copied], unchanged, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("case", ["waiting", "interrupted"])
def test_copy_ahead_makes_the_pages_a_processs_own_and_keeps_what_they_hold(case):
    """After a fork the pages are shared; copy_ahead copies exactly the runs asked for (own_pages sees them as the
    process's own, the others stay shared), holding the same bytes; and nothing once its interrupt has come."""
    done = subprocess.run([sys.executable, "-c", COPY_AHEAD, case], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    copied = [] if case == "interrupted" else [(8, 16), (40, 1)]
    assert done.stdout == f"{copied} True\n"


SPARE = """
import json, os, socket, time
import sympy
from stare_sandbox import template
kernel, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
made = template.Template(mine, {"__name__": "__main__"})
page = os.sysconf("SC_PAGE_SIZE")
warm = {start + offset for start, length in made.warm for offset in range(0, length, page)}
spare = made.spare[0]
for _ in range(200):
    regions = template.writable_regions(open(f"/proc/{spare}/maps").read())
    own = {start + offset for start, length in template.own_pages(f"/proc/{spare}/pagemap", regions)
           for offset in range(0, length, page)}
    if warm <= own:
        break
    time.sleep(0.05)
print(json.dumps({"warm": len(warm), "not_copied": len(warm - own)}))
"""


def test_the_spare_worker_copies_the_pages_a_cell_writes_before_it_is_handed_out(tmp_path):
    """The template learns which pages a worker writes to run any cell (a worker of its own runs WARM_CELL), and
    each spare worker copies them while it waits, so the call that gets it does not fault on them."""
    env = {**os.environ, "HOME": str(tmp_path)}  # the template's scratch dir
    done = subprocess.run([sys.executable, "-c", SPARE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["warm"] > 100 and report["not_copied"] == 0


def test_warm_pages_are_searched_in_private_writable_mappings_up_to_a_gigabyte():
    from stare_sandbox.template import writable_regions

    maps = (
        "7f0000000000-7f0000004000 rw-p 00000000 00:00 0 \n"  # anonymous: searched
        "7f0000004000-7f0000008000 r--p 00000000 08:01 12 /usr/lib/libc.so.6\n"  # read-only
        "7f0000008000-7f000000c000 rw-s 00000000 00:05 3 /dev/shm/x\n"  # shared: writes are not copies
        "7f000000c000-7f004000c000 rw-p 00000000 00:00 0 \n"  # exactly 1 GiB: searched
        "7f004000c000-7f008000d000 rw-p 00000000 00:00 0 \n"  # 1 GiB and a page: left out
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]\n"
    )
    assert writable_regions(maps) == [
        (0x7F0000000000, 0x7F0000004000),
        (0x7F000000C000, 0x7F004000C000),
        (0x7FFD00000000, 0x7FFD00021000),
    ]
