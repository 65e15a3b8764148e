"""Kernel cgroups: each kernel of a pool in its own cgroup (v2, or v1 memory + cpuacct), where cgroups work.

Under CGROUP_DIR in the server's own cgroup, grouped by the pool's uid range (`range_group`): a memory limit for
all of a kernel's processes together, their CPU time counted together, and a way to find and kill them all, also
those that left the kernel's session. Root is needed; `cgroup_problem` says why cgroups do not work here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stare_sandbox.processes import kill_until_gone

__all__ = [
    "CGROUP_DIR",
    "Cgroups",
    "KernelCgroup",
    "cgroup_problem",
    "find_cgroups",
    "prepare_cgroups",
    "range_group",
    "remove_cgroup_dirs",
    "sweep_cgroups",
    "usable_cgroups",
]

CGROUP_DIR = "stare-sandbox"
"""The dir made under this process's own cgroup (in each hierarchy used) that holds its kernels' cgroups."""


@dataclass(frozen=True)
class Cgroups:
    """Where this process's kernels get their cgroups."""

    version: Literal["v1", "v2"]
    memory: Path
    """CGROUP_DIR in the hierarchy with the memory controller."""
    cpu: Path
    """CGROUP_DIR in the hierarchy that counts CPU time: cpuacct on v1, the same dir as `memory` on v2."""

    @property
    def dirs(self) -> tuple[Path, ...]:
        return (self.memory,) if self.memory == self.cpu else (self.memory, self.cpu)

    def as_dict(self) -> dict[str, str]:
        return {"version": self.version, "memory": str(self.memory), "cpu": str(self.cpu)}

    @classmethod
    def from_dict(cls, value: dict) -> Cgroups:
        return cls(value["version"], Path(value["memory"]), Path(value["cpu"]))


def find_cgroups() -> Cgroups | str:
    """The cgroup dirs this process's kernels would use (made by nobody yet), or why there are none.

    cgroup v2 where this process's cgroup offers the memory and cpu controllers, else cgroup v1 where the memory
    and cpuacct hierarchies are mounted. The launcher calls this too: a kernel's launcher is still in its
    server's cgroup when it looks, so both find the same dirs.
    """
    if not sys.platform.startswith("linux"):
        return f"cgroups need Linux; this is {sys.platform}"
    try:
        own = {}  # controller ("" for v2) -> this process's cgroup path
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
        mounts = _cgroup_mounts()
    except OSError as e:
        return f"cannot read this process's cgroups: {e}"
    v2 = _in_mount(mounts.get("cgroup2"), own.get(""))
    if v2 is not None:
        try:
            offered = (v2 / "cgroup.controllers").read_text().split()
        except OSError:
            offered = []
        if {"memory", "cpu"} <= set(offered):
            return Cgroups("v2", v2 / CGROUP_DIR, v2 / CGROUP_DIR)
    memory = _in_mount(mounts.get("memory"), own.get("memory"))
    cpu = _in_mount(mounts.get("cpuacct"), own.get("cpuacct"))
    if memory is not None and cpu is not None:
        return Cgroups("v1", memory / CGROUP_DIR, cpu / CGROUP_DIR)
    where = f"cgroup2 at {mounts['cgroup2'][1]} offers no memory controller" if "cgroup2" in mounts else "no cgroup2"
    return f"{where}, and no cgroup v1 memory and cpuacct hierarchies are mounted"


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """The cgroup mounts: "cgroup2", or a v1 controller -> (root of the mount within its hierarchy, mount point)."""
    mounts = {}
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            dash = fields.index("-")
            kind, options = fields[dash + 1], fields[dash + 3].split(",")
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if kind == "cgroup2":
                mounts.setdefault("cgroup2", (fields[3], point))
            elif kind == "cgroup":
                for controller in {"memory", "cpuacct"} & set(options):
                    mounts.setdefault(controller, (fields[3], point))
    return mounts


def _in_mount(mount: tuple[str, str] | None, path: str | None) -> Path | None:
    """Where cgroup `path` of a hierarchy appears under its mount, if it does."""
    if mount is None or path is None:
        return None
    root, point = mount
    if root == "/":
        return Path(point) / path.lstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return Path(point) / path[len(root) :].lstrip("/")


@functools.lru_cache(maxsize=1)
def cgroup_problem() -> str | None:
    """None if kernels can get cgroups here (the dirs are made, a probe cgroup gets a memory limit), else why not."""
    found = find_cgroups()
    if isinstance(found, str):
        return found
    probe = KernelCgroup(found, f"probe-{os.getpid()}", "kernel")
    try:
        prepare_cgroups(found)
        probe.create(256 * 2**20)
    except OSError as e:
        return f"cannot use cgroup {found.version} at {found.memory}: {e}"
    finally:
        sweep_cgroups(found, probe.group)
    return None


def prepare_cgroups(cgroups: Cgroups) -> None:
    """Make CGROUP_DIR in each hierarchy; on v2 also hand the memory and cpu controllers down to it."""
    for directory in cgroups.dirs:
        directory.mkdir(exist_ok=True)
    if cgroups.version == "v2":
        _delegate(cgroups.memory.parent)  # fails (EBUSY) while it holds processes, unless it is the root cgroup
        _delegate(cgroups.memory)


def _delegate(directory: Path) -> None:
    """cgroup v2: let the children of `directory` have the memory and cpu controllers."""
    if not {"memory", "cpu"} <= set((directory / "cgroup.subtree_control").read_text().split()):
        (directory / "cgroup.subtree_control").write_text("+memory +cpu")


def cpu_seconds(cgroups: Cgroups, directory: Path) -> float | None:
    """CPU time of the processes of the cgroup at `directory` (its last hierarchy's, where the CPU controller is)
    and of its descendants, dead ones included; None if it is gone."""
    try:
        if cgroups.version == "v1":
            return int((directory / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (directory / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    except (FileNotFoundError, KeyError, ValueError):
        return None


def range_group(uid_base: int) -> str:
    """The dir, in CGROUP_DIR, of the cgroups of the kernels of the pool holding the uid range from `uid_base`."""
    return f"uids-{uid_base}"


@dataclass(frozen=True)
class KernelCgroup:
    """One kernel's cgroup, CGROUP_DIR/group/name in each hierarchy of `cgroups`: `group` is its pool's
    (`range_group`: pools hold their uid ranges alone, so no other pool touches it), `name` its scratch dir's."""

    cgroups: Cgroups
    group: str
    name: str

    @property
    def dirs(self) -> tuple[Path, ...]:
        return tuple(d / self.group / self.name for d in self.cgroups.dirs)

    def exists(self) -> bool:
        return self.dirs[0].is_dir()

    def create(self, memory_bytes: int) -> None:
        """Make the cgroup with its memory limit (swap included: no swap for the kernel where the host can tell)."""
        for directory in self.dirs:
            directory.parent.mkdir(parents=True, exist_ok=True)  # CGROUP_DIR too: a pool closing removes it if empty
            if self.cgroups.version == "v2":
                _delegate(directory.parent.parent)
                _delegate(directory.parent)
            directory.mkdir(exist_ok=True)
        memory = self.dirs[0]
        if self.cgroups.version == "v1":
            (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        else:
            (memory / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (memory / "memory.swap.max").write_text("0")

    def join(self, memory_bytes: int) -> None:
        """Create the cgroup and move this process into it (its children follow)."""
        for attempt in range(10):  # a sweep may remove an empty dir we just made: make it again
            try:
                self.create(memory_bytes)
                for directory in self.dirs:
                    (directory / "cgroup.procs").write_text(str(os.getpid()))
                return
            except FileNotFoundError:
                if attempt == 9:
                    raise

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def kill(self) -> int:
        """SIGKILL every process in the cgroup; returns how many."""
        return kill_until_gone(self.pids)

    def remove(self) -> bool:
        """Remove the cgroup if it holds no process (a killed one may take a moment to leave it)."""
        return all(_rmdir_when_empty(directory) for directory in self.dirs)

    def cpu_seconds(self) -> float | None:
        """CPU time of all the cgroup's processes, dead ones included; None if the cgroup is gone."""
        return cpu_seconds(self.cgroups, self.dirs[-1])

    def oom_kills(self) -> int:
        """Processes of the cgroup the kernel's OOM killer has killed for its memory limit (0 if gone)."""
        events = "memory.oom_control" if self.cgroups.version == "v1" else "memory.events"
        try:
            lines = (self.dirs[0] / events).read_text().splitlines()
        except FileNotFoundError:
            return 0
        return int(dict(line.split() for line in lines).get("oom_kill", 0))


def _rmdir_when_empty(directory: Path, wait_s: float = 0.5) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: processes, or killed ones not yet reaped
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


@functools.lru_cache(maxsize=1)
def usable_cgroups() -> Cgroups | None:
    """This process's kernel cgroup dirs if cgroups work here (`cgroup_problem`), else None."""
    found = find_cgroups() if cgroup_problem() is None else None
    return found if isinstance(found, Cgroups) else None


def sweep_cgroups(cgroups: Cgroups, group: str, scratch_root: Path | None = None) -> int:
    """With `scratch_root`: remove the cgroups in `group` whose kernel is gone (its scratch dir removed) and that
    hold no process. Without: end every process in `group`, then remove its cgroups and the group itself.
    Returns how many processes were killed."""
    try:  # a cgroup dir holds its control files too; its subdirs are the cgroups
        names = [e.name for e in os.scandir(cgroups.memory / group) if e.is_dir(follow_symlinks=False)]
    except OSError:  # no such group (or not ours to read)
        return 0
    killed = 0
    for name in names:
        cgroup = KernelCgroup(cgroups, group, name)
        if scratch_root is None:
            killed += cgroup.kill()
            cgroup.remove()
        elif not (Path(scratch_root) / name).exists():
            for directory in cgroup.dirs:
                with contextlib.suppress(OSError):  # busy: processes are still in it; a later sweep tries again
                    directory.rmdir()
    if scratch_root is None:
        for directory in cgroups.dirs:
            _rmdir_when_empty(directory / group)
    return killed


def remove_cgroup_dirs(cgroups: Cgroups) -> None:
    """Remove CGROUP_DIR where no other pool of this cgroup has kernel cgroups in it (then it is busy: kept)."""
    for directory in cgroups.dirs:
        with contextlib.suppress(OSError):
            directory.rmdir()
