"""How a kernel is fenced off from the server and from other kernels (DESIGN section 5).

A kernel is started by jupyter_client from a kernelspec whose argv comes from `kernel_argv`: it runs
`python -m sandbox.launch` (inside `unshare` with namespaces), which sets the fences up and then
starts `ipykernel_launcher`; see that module for the order of the steps.

Always enforced ("process" mode and "namespaces" mode):
- a separate process with rlimits: address space (RLIMIT_AS, so a big allocation raises MemoryError),
  processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps;
- a scrubbed environment (`kernel_env`): nothing of the server's environment (tokens, keys) reaches
  the kernel, not even when the server passes its own environment to jupyter_client;
- a private scratch dir (mode 0700) as working dir, HOME and TMPDIR, removed with `remove_scratch`;
- the kernel dies with the process that started it (on Linux): its first process gets the parent-death
  signal SIGKILL (`setpriv --pdeathsig KILL`, or `_PDEATHSIG_EXEC` where setpriv lacks that option), so a
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
  and RLIMIT_NPROC counts this kernel's processes only.

Not isolated, in any mode:
- everything world-readable on the host stays readable (read-only, not hidden), except that a
  directory others may not enter (such as a 0700 /root holding the interpreter) is replaced by an
  empty tmpfs into which only the interpreter's own directories are bound back;
- CPU time: there is no CPU limit; the server's per-call wall timeout interrupts or restarts;
- total memory: RLIMIT_AS caps each process, so a kernel with `processes` processes may use up to
  `processes * memory_mb` (no cgroup is used); the scratch dir has no size limit, only a per-file one;
- the kernel shares the host kernel (a kernel exploit escapes all of this);
- a server that dies without its clean-up (SIGKILL, a crash) leaves its kernels' scratch dirs (and the
  pool's scratch root) behind: the kernels die, but only a later owner can remove what is left. A server
  killed in the microseconds between forking a kernel's first process and setpriv's prctl leaves that
  kernel running; `kill_uid_processes` ends such a namespace kernel by its slot's uid.
In "process" mode the kernel also runs as the server's uid with the server's view of the network and
file system (so kernels can read each other's scratch dirs and connection files), RLIMIT_NPROC counts
all processes of that uid (root is exempt from it entirely), and a kernel's children can outlive it
(the kernel itself dies with the server; ipykernel's parent poller also ends it within a second, also
where there is no parent-death signal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "UID_BASE",
    "Isolation",
    "IsolationMode",
    "Limits",
    "detect_isolation",
    "kernel_argv",
    "kernel_env",
    "kill_uid_processes",
    "make_scratch",
    "remove_scratch",
]

UID_BASE = 61000
"""Kernels run as uid (and gid) UID_BASE + slot, the slot chosen by the caller (0..999); no passwd entry needed."""

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

    def __post_init__(self) -> None:
        minimum = {"memory_mb": 256, "processes": 16, "file_size_mb": 1, "open_files": 64}
        for name, low in minimum.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Limits.{name} must be an integer >= {low}; got {value!r}")


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

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_NAMESPACES = Isolation("namespaces", True, True, True, True, True, True, True)
_PROCESS = Isolation("process", False, False, False, False, True, True, True)


def detect_isolation(requested: IsolationMode = "auto") -> Isolation:
    """The isolation kernels will get: "process" as asked, "namespaces" if the probe works (else
    RuntimeError saying why), "auto" the best that works here. The probe runs once per process."""
    if requested not in _MODES:
        raise ValueError(f"isolation must be one of {', '.join(_MODES)}; got {requested!r}")
    _setpriv_with_pdeathsig()  # probed here, once, so that kernel_argv never waits for it in an event loop
    if requested == "process":
        return _PROCESS
    problem = _namespace_problem()
    if problem is None:
        return _NAMESPACES
    if requested == "namespaces":
        raise RuntimeError(f"isolation='namespaces' does not work here: {problem}. Use isolation='process' or 'auto'.")
    return _PROCESS


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
    ignored and the kernel runs as the server's uid. The argv is for a kernel this process starts: the
    kernel dies when the thread that starts it ends (see the module docstring).
    """
    namespaces = isolation.mode == "namespaces"
    if namespaces and (uid is None or isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0):
        raise ValueError(
            "namespace isolation needs a kernel uid > 0 (UID_BASE + slot): as root inside its namespaces a "
            f"kernel could remount the file system writable; got {uid!r}"
        )
    return _launcher_argv(namespaces, limits, uid if namespaces else None, python, probe=False)


def _launcher_argv(namespaces: bool, limits: Limits, uid: int | None, python: str, *, probe: bool) -> list[str]:
    launch = [
        python,
        "-m",
        "sandbox.launch",
        f"--memory-mb={limits.memory_mb}",
        f"--processes={limits.processes}",
        f"--file-size-mb={limits.file_size_mb}",
        f"--open-files={limits.open_files}",
    ]
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


# Runs its argv after the pid with the parent-death signal SIGKILL; for a setpriv without --pdeathsig
# (util-linux < 2.33). If the parent died before prctl, no signal will ever come: then exit instead.
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
    setpriv = _setpriv_with_pdeathsig()
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "KILL", "--"]
    return [python, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid())]


@functools.lru_cache(maxsize=1)
def _setpriv_with_pdeathsig() -> str | None:
    """util-linux `setpriv` if it is on PATH and knows --pdeathsig (2.33 and later), else None."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    try:
        argv = [setpriv, "--pdeathsig", "KILL", "--", sys.executable, "-I", "-S", "-c", ""]
        done = subprocess.run(argv, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return setpriv if done.returncode == 0 else None


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
    """A new private dir (mode 0700) under `root`, owned by `uid` (and gid `uid`) when given."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="kernel-", dir=root))
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


def kill_uid_processes(uid: int) -> int:
    """SIGKILL every process of real uid `uid` visible here; returns how many were killed.

    A kernel's processes all die with it in namespace mode, and the kernel dies with its server; this is
    for a kernel left behind all the same (see "Not isolated" above): call it for each slot's uid before
    reusing the slot.
    """
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill the processes of uid {uid} (root or the server's own uid)")
    killed = 0
    for _ in range(20):  # the processes may still be forking while we kill
        pids = _pids_of_uid(uid)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
        # zombies are already dead (their parent has yet to reap them); Uid: real effective saved fs
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids
