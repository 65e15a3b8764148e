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

Not root: where the host allows unprivileged user namespaces, "namespaces" mode still holds, through a user
namespace per kernel (`Isolation.user_namespace`): `unshare --user --map-root-user` maps the server's uid to root
inside, the launcher makes the mounts below, hides the other kernels' scratch dirs (same uid) under an empty
tmpfs and drops every capability for good before the kernel starts. The kernel then runs as the server's uid
without capabilities instead of a dedicated uid, and RLIMIT_NPROC counts its own processes only (Linux counts it
per user namespace), not the thousands of threads the same user runs elsewhere (a Ray job's engines and ranks).

Enforced only in "namespaces" mode (root, or unprivileged user namespaces, and util-linux `unshare` needed;
`detect_isolation` probes):
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
- each kernel of a pool gets its own cgroup (`cgroups.KernelCgroup`: v2, or v1 memory + cpuacct) in a dir of its
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
pool's uid range ends them (by cgroup, or by their HOME: `processes.kill_processes_with_home`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stare_sandbox.cgroups import Cgroups, KernelCgroup, range_group, usable_cgroups
from stare_sandbox.processes import session_cpu_seconds

__all__ = [
    "UID_BASE",
    "UID_RANGE_SIZE",
    "Isolation",
    "IsolationMode",
    "KernelMeter",
    "Limits",
    "detect_isolation",
    "kernel_argv",
    "kernel_env",
    "make_scratch",
    "remove_scratch",
    "scratch_bytes",
    "scratch_prefix",
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
    user_namespace: bool = False
    """A server that is not root: each kernel in its own user namespace, as the server's uid with no capabilities
    (its other fences as with root); RLIMIT_NPROC then counts the kernel's own processes only."""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_NAMESPACES = Isolation("namespaces", True, True, True, True, True, True, True)
_USER_NAMESPACE = Isolation("namespaces", True, True, True, False, True, True, True, user_namespace=True)
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
        return dataclasses.replace(_NAMESPACES if os.geteuid() == 0 else _USER_NAMESPACE, cgroup=cgroup)
    if requested == "namespaces":
        raise RuntimeError(f"isolation='namespaces' does not work here: {problem}. Use isolation='process' or 'auto'.")
    return dataclasses.replace(_PROCESS, cgroup=cgroup)


@functools.lru_cache(maxsize=1)
def _namespace_problem() -> str | None:
    """None if the namespace launcher works here, else what is wrong. Runs the real launcher path once."""
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces need Linux; this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "the util-linux program `unshare` is not on PATH"
    root = os.geteuid() == 0
    uid = _PROBE_UID if root else None  # not root: a user namespace instead of a kernel uid
    scratch = make_scratch(Path(tempfile.gettempdir()), uid)
    try:
        argv = _launcher_argv(True, Limits(), uid, sys.executable, probe=True)
        argv = [str(scratch / "probe.json") if a == "{connection_file}" else a for a in argv]
        try:
            env = kernel_env(scratch)
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"the probe `{' '.join(argv)}` did not finish in {_PROBE_TIMEOUT_S} s"
        if done.returncode != 0:
            why = f"the probe `{' '.join(argv)}` exited with status {done.returncode}: {done.stderr.strip()[-800:]}"
            if not root:
                why = (f"the server runs as uid {os.geteuid()}, not root, and this host does not let it make a user "
                       f"namespace ({_user_namespace_settings()}); {why}")  # fmt: skip
            return why
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


def kernel_argv(
    isolation: Isolation, limits: Limits, uid: int | None, python: str = sys.executable, template_warmup: str = ""
) -> list[str]:
    """The kernelspec argv; "{connection_file}" occurs once and jupyter_client substitutes it.

    With `template_warmup` (base64 warm-up code, stare_sandbox.template.encode_warmup) the kernel runs user code in
    workers forked from a clean template (pool.clean_state: fork); without, it is plain ipykernel.
    With namespaces the kernel runs as `uid` (UID_BASE + slot, required), or, with `isolation.user_namespace` (a
    server that is not root), in its own user namespace as the server's uid without capabilities (`uid` ignored); in
    process mode `uid` is ignored and the kernel runs as the server's uid. With `isolation.cgroup` and a uid range held
    (`isolation.uid_base`, set by the pool) the launcher puts the kernel in its own cgroup (`KernelCgroup`).
    The argv is for a kernel this process starts: the kernel dies when the thread that starts it ends (see
    the module docstring).
    """
    namespaces = isolation.mode == "namespaces"
    if isolation.user_namespace:
        uid = None
    elif namespaces and (uid is None or isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0):
        raise ValueError(
            "namespace isolation needs a kernel uid > 0 (UID_BASE + slot): as root inside its namespaces a "
            f"kernel could remount the file system writable; got {uid!r}"
        )
    group = range_group(isolation.uid_base) if isolation.cgroup and isolation.uid_base else None
    return _launcher_argv(
        namespaces, limits, uid if namespaces else None, python, probe=False, group=group, warmup=template_warmup
    )


def _launcher_argv(
    namespaces: bool,
    limits: Limits,
    uid: int | None,
    python: str,
    *,
    probe: bool,
    group: str | None = None,
    warmup: str = "",
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
    if warmup:
        launch.append(f"--template-warmup={warmup}")
    if probe:
        launch.append("--probe")
    die_with_owner = _die_with_parent(python)
    if not namespaces:
        return [*die_with_owner, *launch, "--", "{connection_file}"]
    # --fork makes the launcher PID 1 of the new PID namespace (it stays as the kernel's init); --kill-child
    # SIGKILLs it if unshare dies, which takes every process of the namespace along.
    unshare = shutil.which("unshare") or "unshare"
    ns = [unshare, "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc", "--mount", "--"]
    if uid is None:
        # Not root: a user namespace in which the server's uid is root, so that the launcher can make the mounts;
        # it then drops every capability for good (--drop-capabilities) before any user code runs.
        ns = [unshare, "--user", "--map-root-user", *ns[1:]]
        return [*die_with_owner, *ns, *launch, "--drop-capabilities", "--readonly-root", "--", "{connection_file}"]
    return [*die_with_owner, *ns, *launch, f"--uid={uid}", "--readonly-root", "--", "{connection_file}"]


def _user_namespace_settings() -> str:
    """The host settings that allow or forbid unprivileged user namespaces, as found, for an error message."""
    found = []
    for name in ("user/max_user_namespaces", "kernel/unprivileged_userns_clone",
                 "kernel/apparmor_restrict_unprivileged_userns"):  # fmt: skip
        try:
            found.append(f"{name.replace('/', '.')}={Path('/proc/sys', name).read_text().strip()}")
        except OSError:
            pass
    return ", ".join(found) or "no sysctl found"


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
    except (OSError, RecursionError):
        # A tree deeper than Python's recursive walks can follow (the recursion limit, or paths over PATH_MAX):
        # coreutils walk any depth, by file descriptor. chmod -R never follows a link it meets.
        for argv in (["chmod", "-R", "u+rwx", "--", str(path)], ["rm", "-rf", "--", str(path)]):
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.path.lexists(path):
            raise OSError(f"the scratch dir {path} could not be removed") from None


KERNEL_FILES = ("ipc-", "kernel.json", ".ipython")
"""How the names begin of what a scratch dir holds for the kernel itself (its connection file and sockets, IPython's
profile dir): kept when the dir is emptied between runs."""


def empty_scratch(path: str | Path) -> int:
    """Remove everything in a kernel's scratch dir but the kernel's own files (KERNEL_FILES), also dirs the code
    made read-only or unreadable; symbolic links are removed, never followed. Returns the disk space what it removed
    took (as scratch_bytes counts it, measured once each dir is readable). Raises (OSError, or RecursionError for a
    tree deeper than the interpreter's recursion limit) if something could not be removed: the kernel must then not
    serve again."""
    with os.scandir(path) as entries:
        left = [e for e in entries if not e.name.startswith(KERNEL_FILES)]
    removed, seen = 0, set()
    for entry in left:
        if entry.is_dir(follow_symlinks=False):
            _make_removable(Path(entry.path))
            removed += _tree_bytes(entry.path, seen)
            shutil.rmtree(entry.path)
        else:
            removed += _tree_bytes(entry.path, seen)
            os.remove(entry.path)
    return removed


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
    return _tree_bytes(path, set())


def _tree_bytes(path: str | Path, seen: set[tuple[int, int]]) -> int:
    """scratch_bytes, counting no inode in `seen` (and adding those it counts)."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return 0
    total, todo = 0, [path] if stat.S_ISDIR(top.st_mode) else []
    if (top.st_dev, top.st_ino) not in seen:
        seen.add((top.st_dev, top.st_ino))
        total += top.st_blocks * 512
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
                todo.append(entry.path)
    return total


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
