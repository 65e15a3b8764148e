"""How a kernel is fenced off from the server and from other kernels (DESIGN section 5).

A kernel is started by jupyter_client from a kernelspec whose argv comes from `kernel_argv`: it runs
`python -m stare_sandbox.launch` (inside `unshare` with namespaces), which sets the fences up and then
starts `ipykernel_launcher`; see that module for the order of the steps.

Always enforced ("process" mode and "namespaces" mode):
- a separate process with rlimits: address space (RLIMIT_AS, so a big allocation raises MemoryError),
  processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps;
- a scrubbed environment (`kernel_env`): nothing of the server's environment (tokens, keys) reaches
  the kernel, not even when the server passes its own environment to jupyter_client;
- a private scratch dir (mode 0700) as working dir, HOME and TMPDIR, removed with `remove_scratch`;
- the kernel dies with the process that started it (on Linux): its first process gets the parent-death
  signal SIGKILL (`_PDEATHSIG_EXEC`, which also refuses to start the kernel if its starter is already gone), so a
  server or in-process pool that is SIGKILLed or crashes, skipping its own clean-up, takes its kernels
  along at once. The signal fires when the *thread* that started the kernel ends, not the process:
  a pool must live in one event loop whose thread outlives it (asyncio.run in the main thread, uvicorn's
  loop, a test client's portal thread); kernels started from a thread that then ends are killed.

Enforced only in "namespaces" mode (root and util-linux `unshare` needed; `detect_isolation` probes):
- no network: own network namespace whose only interface, loopback, is down (kernels talk to the
  server over IPC sockets in the scratch dir, which need no network); own IPC namespace;
- own PID namespace: the kernel cannot see or signal the server, other kernels or any host process;
  when the kernel dies or is killed, every process it started dies with it (also those that left its
  process group), and orphans are reaped meanwhile. The parent-death signal is set on `unshare`, and
  `unshare --kill-child` passes the death on to the namespace's PID 1, so the whole namespace dies with
  the server too;
- read-only file system outside the scratch dir (own mount namespace; `/proc` is the namespace's own,
  `/dev/shm` a small private tmpfs);
- a dedicated unprivileged uid per kernel (`UID_BASE + slot`, no passwd entry, no supplementary
  groups, no-new-privileges so setuid programs do not elevate): other kernels' scratch dirs, the
  connection files (which hold the HMAC key) and root-only files such as /etc/shadow are unreadable,
  and RLIMIT_NPROC counts this kernel's processes only. A pool's slots are the uid range it holds
  exclusively on this host (stare_sandbox.ownership), so no other sandbox's kernel ever has the same uid.

Caps, where cgroups work (`detect_isolation` probes; root is needed; `Isolation.cgroup` says which):
- each kernel of a pool gets its own cgroup (`KernelCgroup`: v2, or v1 memory + cpuacct) in a dir of its
  pool's uid range under a "stare-sandbox" dir in the server's own cgroup, joined by the launcher before
  anything else, so every process the kernel starts is in it, also those that leave its session: a memory
  limit for all of them together (`Limits.kernel_memory_mb`, swap included where the host accounts it),
  their CPU time for the per-call cap, and a way to find and kill them all;
- without cgroups, only the per-process rlimits bound memory, and a call's CPU time is that of the
  processes in the kernel's session (a process that calls setsid() escapes the count).
The per-call caps themselves (CPU seconds, scratch quota) are enforced by the pool (kernel.Kernel.execute).

Not isolated, in any mode:
- everything world-readable on the host stays readable (read-only, not hidden), except that a
  directory others may not enter (such as a 0700 /root holding the interpreter) is replaced by an
  empty tmpfs into which only the interpreter's own directories are bound back;
- CPU time has no limit over a kernel's life, only per call (`Limits.call_cpu_s`, checked twice a second
  while the call runs, so a call may overshoot by what its processes use in half a second);
- total memory, without cgroups: RLIMIT_AS caps each process, so a kernel with `processes` processes may
  use up to `processes * memory_mb`;
- the scratch quota (`Limits.scratch_mb`) counts the files in the scratch dir, twice a second during a
  call and after it: a file deleted while a process still holds it open is not counted;
- the kernel shares the host kernel (a kernel exploit escapes all of this);
- a server that dies without its clean-up (SIGKILL, a crash) leaves its kernels' scratch dirs, its
  cgroups and, in process mode, processes its kernels started behind; the next owner of its uid range
  removes them (stare_sandbox.ownership).
In "process" mode the kernel also runs as the server's uid with the server's view of the network and
file system (so kernels can read each other's scratch dirs and connection files), RLIMIT_NPROC counts
all processes of that uid (root is exempt from it entirely), and a kernel's children can outlive it
(the kernel itself dies with the server; ipykernel's parent poller also ends it within a second, also
where there is no parent-death signal) until the pool closes (with cgroups) or the next owner of the
pool's uid range ends them (by cgroup, or by their HOME: `kill_processes_with_home`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "UID_BASE",
    "UID_RANGE_SIZE",
    "Cgroups",
    "Isolation",
    "IsolationMode",
    "KernelCgroup",
    "Limits",
    "cgroup_problem",
    "detect_isolation",
    "find_cgroups",
    "kernel_argv",
    "kernel_env",
    "KernelMeter",
    "kill_processes_with_home",
    "kill_uid_processes",
    "make_scratch",
    "prepare_cgroups",
    "range_group",
    "remove_cgroup_dirs",
    "remove_scratch",
    "scratch_bytes",
    "session_cpu_seconds",
    "sweep_cgroups",
    "usable_cgroups",
]

UID_BASE = 61000
"""Kernels run as uid (and gid) UID_BASE + slot, the slot chosen by the caller; no passwd entry needed. A pool's
slots are those of the uid range it holds (stare_sandbox.ownership), UID_RANGE_SIZE uids from a multiple of it."""
UID_RANGE_SIZE = 1000
"""Kernel uids per range (stare_sandbox.ownership), so also the most kernels one pool may have alive at once."""

_PROBE_UID = UID_BASE - 1  # the namespace probe's own uid, never a kernel's
_PROBE_TIMEOUT_S = 30

IsolationMode = Literal["auto", "namespaces", "process"]
_MODES = ("auto", "namespaces", "process")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one kernel, set as soft and hard rlimits before the kernel starts."""

    memory_mb: int = 4096
    """RLIMIT_AS of each kernel process in MiB; torch-sized code needs at least 2048 of address space."""
    processes: int = 64
    """RLIMIT_NPROC: processes and threads of the kernel's uid (the kernel and its init use about 12)."""
    file_size_mb: int = 64
    """RLIMIT_FSIZE in MiB: the largest file the kernel can write; also the size of its private /dev/shm."""
    open_files: int = 256
    """RLIMIT_NOFILE: open file descriptors per process (the kernel itself uses about 30)."""
    kernel_memory_mb: int = 4096
    """Memory of all the kernel's processes together in MiB (its cgroup's limit; swap counts too where the host
    accounts it). Only where cgroups work (/healthz `caps`); going over it stops the call and replaces the kernel."""
    call_cpu_s: float = 60.0
    """CPU seconds one call may use, all the kernel's processes together; going over it stops the call and
    replaces the kernel. 0 = no cap (the wall-clock timeout still applies)."""
    scratch_mb: int = 1024
    """MiB the kernel's scratch dir may hold (a session's files live there); going over it stops the call and
    replaces the kernel, which removes the files. 0 = no quota (RLIMIT_FSIZE still caps each file)."""

    def __post_init__(self) -> None:
        minimum = {
            "memory_mb": 256,
            "processes": 16,
            "file_size_mb": 1,
            "open_files": 64,
            "kernel_memory_mb": 128,
            "scratch_mb": 0,
        }
        for name, low in minimum.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Limits.{name} must be an integer >= {low}; got {value!r}")
        cpu = self.call_cpu_s
        if not isinstance(cpu, (int, float)) or isinstance(cpu, bool) or not 0 <= cpu < float("inf"):
            raise ValueError(f"Limits.call_cpu_s must be a number >= 0 (0 = no cap); got {cpu!r}")


@dataclass(frozen=True)
class Isolation:
    """What is actually enforced (reported by /healthz)."""

    mode: Literal["namespaces", "process"]
    """How kernels are fenced: own Linux namespaces and uid, or only a separate process."""
    network: bool
    """No network: own network namespace with loopback down."""
    pid_namespace: bool
    """Cannot see or signal the server or other kernels; its processes die with it."""
    readonly_root: bool
    """File system read-only outside the scratch dir (own mount namespace)."""
    unprivileged_user: bool
    """Runs as a dedicated unprivileged uid (UID_BASE + slot)."""
    rlimits: bool
    """Address space, process, file size and open file limits (see Limits)."""
    scrubbed_env: bool
    """Only the variables of `kernel_env`; nothing from the server's environment."""
    scratch_dir: bool
    """Private working dir, HOME and TMPDIR, removed when the kernel closes."""
    cgroup: Literal["v1", "v2", ""] = ""
    """Each kernel in its own cgroup ("v1" or "v2"): a memory limit for all its processes, their CPU time
    measured together; "" = none (no root, or the host offers no usable memory controller)."""
    uid_base: int = 0
    """First uid of the kernel uid range the pool holds alone on this host (stare_sandbox.ownership); its kernels'
    cgroups are grouped by it too. 0 = no range held (the isolation as probed, before a pool claims one)."""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_NAMESPACES = Isolation("namespaces", True, True, True, True, True, True, True)
_PROCESS = Isolation("process", False, False, False, False, True, True, True)


def detect_isolation(requested: IsolationMode = "auto", cgroups: bool = True) -> Isolation:
    """The isolation kernels will get: "process" as asked, "namespaces" if the probe works (else
    RuntimeError saying why), "auto" the best that works here; with cgroups where they work (see
    `cgroup_problem`), unless `cgroups` is False (then the cgroup tree is not touched). The probes run once
    per process."""
    if requested not in _MODES:
        raise ValueError(f"isolation must be one of {', '.join(_MODES)}; got {requested!r}")
    found = usable_cgroups() if cgroups else None
    cgroup = found.version if found is not None else ""
    if requested == "process":
        return dataclasses.replace(_PROCESS, cgroup=cgroup)
    problem = _namespace_problem()
    if problem is None:
        return dataclasses.replace(_NAMESPACES, cgroup=cgroup)
    if requested == "namespaces":
        raise RuntimeError(f"isolation='namespaces' does not work here: {problem}. Use isolation='process' or 'auto'.")
    return dataclasses.replace(_PROCESS, cgroup=cgroup)


@functools.lru_cache(maxsize=1)
def _namespace_problem() -> str | None:
    """None if the namespace launcher works here, else what is wrong. Runs the real launcher path once."""
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces need Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"creating namespaces and switching to kernel uids needs root; the server runs as uid {os.geteuid()}"
    if shutil.which("unshare") is None:
        return "the util-linux program `unshare` is not on PATH"
    scratch = make_scratch(Path(tempfile.gettempdir()), _PROBE_UID)
    try:
        argv = _launcher_argv(True, Limits(), _PROBE_UID, sys.executable, probe=True)
        argv = [str(scratch / "probe.json") if a == "{connection_file}" else a for a in argv]
        try:
            env = kernel_env(scratch)
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"the probe `{' '.join(argv)}` did not finish in {_PROBE_TIMEOUT_S} s"
        if done.returncode != 0:
            return f"the probe `{' '.join(argv)}` exited with status {done.returncode}: {done.stderr.strip()[-800:]}"
        try:
            report = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return f"the probe printed no JSON report: {done.stdout[-300:]!r} {done.stderr[-500:]!r}"
        failed = sorted(key for key, ok in report.items() if ok is not True)
        if failed:
            return f"the probe found these fences not working: {', '.join(failed)} (report: {report})"
        return None
    finally:
        # No need to kill anything: the probe's processes die with its PID namespace (a timeout kills
        # unshare, and --kill-child its child); killing by uid could hit a concurrent probe.
        remove_scratch(scratch)


def kernel_argv(isolation: Isolation, limits: Limits, uid: int | None, python: str = sys.executable) -> list[str]:
    """The kernelspec argv; "{connection_file}" occurs once and jupyter_client substitutes it.

    With namespaces the kernel runs as `uid` (UID_BASE + slot, required); in process mode `uid` is
    ignored and the kernel runs as the server's uid. With `isolation.cgroup` and a uid range held
    (`isolation.uid_base`, set by the pool) the launcher puts the kernel in its own cgroup (`KernelCgroup`).
    The argv is for a kernel this process starts: the kernel dies when the thread that starts it ends (see
    the module docstring).
    """
    namespaces = isolation.mode == "namespaces"
    if namespaces and (uid is None or isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0):
        raise ValueError(
            "namespace isolation needs a kernel uid > 0 (UID_BASE + slot): as root inside its namespaces a "
            f"kernel could remount the file system writable; got {uid!r}"
        )
    group = range_group(isolation.uid_base) if isolation.cgroup and isolation.uid_base else None
    return _launcher_argv(namespaces, limits, uid if namespaces else None, python, probe=False, group=group)


def _launcher_argv(
    namespaces: bool, limits: Limits, uid: int | None, python: str, *, probe: bool, group: str | None = None
) -> list[str]:
    launch = [
        python,
        "-m",
        "stare_sandbox.launch",
        f"--memory-mb={limits.memory_mb}",
        f"--processes={limits.processes}",
        f"--file-size-mb={limits.file_size_mb}",
        f"--open-files={limits.open_files}",
    ]
    if group is not None:
        launch += [f"--cgroup-group={group}", f"--cgroup-memory-mb={limits.kernel_memory_mb}"]
    if probe:
        launch.append("--probe")
    die_with_owner = _die_with_parent(python)
    if not namespaces:
        return [*die_with_owner, *launch, "--", "{connection_file}"]
    # --fork makes the launcher PID 1 of the new PID namespace (it stays as the kernel's init); --kill-child
    # SIGKILLs it if unshare dies, which takes every process of the namespace along.
    unshare = shutil.which("unshare") or "unshare"
    ns = [unshare, "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc", "--mount", "--"]
    return [*die_with_owner, *ns, *launch, f"--uid={uid}", "--readonly-root", "--", "{connection_file}"]


# Runs its argv after the pid with the parent-death signal SIGKILL. If the parent died before prctl, no signal
# will ever come: then it exits instead. (util-linux `setpriv --pdeathsig` has no such check, so a starter killed
# between fork and setpriv's prctl would leave its kernel running; this costs ~7 ms more per kernel start.)
_PDEATHSIG_EXEC = """
import ctypes, os, sys
prctl = ctypes.CDLL(None, use_errno=True).prctl
prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
if prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.exit(f"sandbox: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):
    sys.exit("sandbox: the process that started this kernel has exited")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _die_with_parent(python: str) -> list[str]:
    """The argv prefix that makes what follows get SIGKILL when the thread that starts it (in this process) ends.

    PR_SET_PDEATHSIG survives exec (unshare, the launcher, the kernel), but not a change of uid: the launcher
    sets it again after dropping root. Only Linux has it; elsewhere ipykernel's parent poller is all there is.
    """
    if not sys.platform.startswith("linux"):
        return []
    return [python, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid())]


def kernel_env(scratch: Path) -> dict[str, str]:
    """The kernel's whole environment: nothing is taken from the server's."""
    scratch = Path(scratch)
    return {
        # the interpreter's own bin dir first, so `python` and `pip` in user code mean this interpreter
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(scratch),
        "TMPDIR": str(scratch),
        "IPYTHONDIR": str(scratch / ".ipython"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def make_scratch(root: Path, uid: int | None) -> Path:
    """A new private dir (mode 0700) under `root`, owned by `uid` (and gid `uid`) when given.

    Named `kernel-<pid of this process>-<random>`: a later owner of this process's uid range tells the dirs
    this process left in a shared scratch root by that pid (stare_sandbox.ownership).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    prefix = scratch_prefix(os.getpid())
    while True:  # 3 random characters (mkdtemp's 8 made socket paths in deep temp dirs too long)
        path = root / (prefix + "".join(random.choices(_BASE36, k=3)))
        try:
            path.mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def remove_scratch(path: Path) -> None:
    """Remove a scratch dir and everything in it, also dirs the kernel made read-only or unreadable.

    A missing dir is fine. Symbolic links are removed, never followed.
    """
    try:
        _make_removable(Path(path))
        shutil.rmtree(path)
    except FileNotFoundError:
        return


def _make_removable(directory: Path) -> None:
    # Without root (process mode) a dir the kernel chmod-ed to 0500 or 0000 blocks rmtree; with root
    # this is a no-op. lstat, so a link the kernel planted never makes us chmod outside the scratch dir.
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        return
    os.chmod(directory, 0o700)
    with os.scandir(directory) as entries:
        subdirs = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    for sub in subdirs:
        with contextlib.suppress(FileNotFoundError):
            _make_removable(sub)


def scratch_prefix(pid: int) -> str:
    """How the names of the scratch dirs made by process `pid` begin (`make_scratch`): the pid in base 36, since
    a kernel's zmq socket paths inside it must stay under the 107 bytes a Unix socket path may have."""
    digits, rest = "", pid
    while True:
        rest, digit = divmod(rest, 36)
        digits = _BASE36[digit] + digits
        if not rest:
            return f"kernel-{digits}-"


_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def scratch_bytes(path: Path) -> int:
    """Disk space `path` and everything under it take (allocated blocks, each inode once, as `du -s`); links are
    not followed. 0 if it does not exist."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return 0
    total, seen = top.st_blocks * 512, {(top.st_dev, top.st_ino)}
    todo = [Path(path)]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                todo.append(Path(entry.path))
    return total


def kill_uid_processes(uids: int | range) -> int:
    """SIGKILL every process whose real uid is `uids` (or in that range) visible here; returns how many were killed.

    A kernel's processes all die with it in namespace mode, and the kernel dies with its server; this is
    for a kernel left behind all the same (see "Not isolated" above): stare_sandbox.ownership calls it for the
    whole uid range a pool takes over.
    """
    wanted = range(uids, uids + 1) if isinstance(uids, int) else uids
    if 0 in wanted or os.getuid() in wanted:
        raise ValueError(f"refusing to kill the processes of uid {uids} (root or the server's own uid)")
    return _kill_until_gone(lambda: [pid for pid, uid in _process_uids() if uid in wanted])


def _kill_until_gone(find: Callable[[], list[int]]) -> int:
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

    return _kill_until_gone(find)


def session_cpu_seconds(session: int) -> float:
    """CPU seconds (user + system, with those of reaped children) of the processes in session `session`.

    The per-call CPU measure where a kernel has no cgroup: jupyter_client starts each kernel in its own session.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == session:  # fields[k] is field k+3 of proc(5): session, then utime .. cstime
            total += sum(int(x) for x in fields[11:15])
    return total / tick


# --- cgroups -----------------------------------------------------------------------------------------

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
        return _kill_until_gone(self.pids)

    def remove(self) -> bool:
        """Remove the cgroup if it holds no process (a killed one may take a moment to leave it)."""
        return all(_rmdir_when_empty(directory) for directory in self.dirs)

    def cpu_seconds(self) -> float | None:
        """CPU time of all the cgroup's processes, dead ones included; None if the cgroup is gone."""
        cpu = self.dirs[-1]
        try:
            if self.cgroups.version == "v1":
                return int((cpu / "cpuacct.usage").read_text()) / 1e9
            return int(dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())["usage_usec"]) / 1e6
        except (FileNotFoundError, KeyError, ValueError):
            return None

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


class KernelMeter:
    """What one kernel uses, all its processes together: CPU seconds, OOM kills, scratch bytes; and killing them.

    By the kernel's cgroup (in `group` of `cgroups`, its pool's) where it has one; else CPU time is that of the
    processes in the kernel's session (`session`: the pid of its first process, which jupyter_client makes a
    session leader) and nothing counts OOM kills.
    """

    def __init__(self, scratch: Path, session: int | None, group: str, cgroups: Cgroups | None):
        cgroup = KernelCgroup(cgroups, group, Path(scratch).name) if cgroups is not None else None
        self.cgroup = cgroup if cgroup is not None and cgroup.exists() else None
        self.scratch = Path(scratch)
        self.session = session

    def cpu_seconds(self) -> float:
        used = self.cgroup.cpu_seconds() if self.cgroup is not None else None
        if used is None:
            used = session_cpu_seconds(self.session) if self.session else 0.0
        return used

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def scratch_bytes(self) -> int:
        return scratch_bytes(self.scratch)

    def kill(self) -> None:
        """SIGKILL every process of the kernel now: its cgroup, else its process group."""
        if self.cgroup is not None:
            self.cgroup.kill()
        elif self.session:
            with contextlib.suppress(OSError):
                os.killpg(self.session, signal.SIGKILL)


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
