"""Processes seen through /proc: find and kill them by uid or by HOME, and count a session's CPU time.

For what a kernel leaves behind and for the per-call CPU cap where a kernel has no cgroup (isolation.py, "Not
isolated"); also the kill loop the cgroups (cgroups.py) use for the processes in one.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "kill_processes_with_home",
    "kill_uid_processes",
    "kill_until_gone",
    "parent_of",
    "process_table",
    "session_cpu_seconds",
]


def kill_uid_processes(uids: int | range) -> int:
    """SIGKILL every process whose real uid is `uids` (or in that range) visible here; returns how many were killed.

    A kernel's processes all die with it in namespace mode, and the kernel dies with its server; this is
    for a kernel left behind all the same (isolation.py, "Not isolated"): stare_sandbox.ownership calls it for the
    whole uid range a pool takes over.
    """
    wanted = range(uids, uids + 1) if isinstance(uids, int) else uids
    if 0 in wanted or os.getuid() in wanted:
        raise ValueError(f"refusing to kill the processes of uid {uids} (root or the server's own uid)")
    return kill_until_gone(lambda: [pid for pid, uid in _process_uids() if uid in wanted])


def kill_until_gone(find: Callable[[], list[int]]) -> int:
    """SIGKILL the pids `find()` returns, again while it returns any (at most 20 rounds); how many were killed."""
    killed = 0
    for _ in range(20):  # the processes may still be forking while we kill
        pids = find()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def _process_uids() -> list[tuple[int, int]]:
    """(pid, real uid) of every live process; zombies are already dead (their parent has yet to reap them)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
        # Uid: real effective saved fs
        if not fields["State"].strip().startswith("Z"):
            found.append((int(entry.name), int(fields["Uid"].split()[0])))
    return found


def kill_processes_with_home(prefix: str) -> int:
    """SIGKILL every process of this uid (but this one) whose HOME starts with `prefix`; returns how many.

    For what a process-mode kernel started and left behind: its children keep the kernel's environment, whose
    HOME is its scratch dir, unless they changed it (cgroups catch those too, where they work).
    """
    me = os.getpid()

    def find() -> list[int]:
        pids = []
        for pid, uid in _process_uids():
            if uid != os.getuid() or pid == me:
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            home = next((v[5:] for v in environ if v.startswith(b"HOME=")), b"")
            if home.startswith(os.fsencode(prefix)):
                pids.append(pid)
        return pids

    return kill_until_gone(find)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): fields[k] is field k+3 of
    proc(5), so fields[0] is the state, [1] the parent, [3] the session, [11:15] the CPU times; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session) of every live process visible here; zombies are left out (already dead)."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None and fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def session_cpu_seconds(session: int) -> float:
    """CPU seconds (user + system, with those of reaped children) of the processes in session `session`.

    The per-call CPU measure where a kernel has no cgroup: jupyter_client starts each kernel in its own session.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None and int(fields[3]) == session:
            total += sum(int(x) for x in fields[11:15])
    return total / tick
