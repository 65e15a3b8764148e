"""Kernel launcher: `python -m stare_sandbox.launch [flags] -- CONNECTION_FILE` (argv from isolation.kernel_argv).

Sets the fences up, then runs `python -m ipykernel_launcher -f CONNECTION_FILE`. The scratch dir is the
connection file's directory. In namespace mode it runs as root inside the new namespaces made by
`unshare`, as PID 1 of the new PID namespace, and does in this order:

0. --cgroup-group, --cgroup-memory-mb: makes the kernel's cgroup (cgroups.KernelCgroup: in its pool's
   group, named after the scratch dir) with that memory limit and moves itself into it, so everything the
   kernel starts is counted and capped there; first removes the empty cgroups of the pool's kernels that are
   gone. Still in the server's cgroup when it looks, so it finds the same cgroup dirs as the server.
1. --readonly-root: makes all mounts private, replaces directories the kernel uid may not enter on
   the way to the interpreter or the scratch dir (a 0700 /root) by a tmpfs with only those paths
   bound back, bind-mounts the scratch dir onto itself (so it stays writable), mounts a private tmpfs
   on /dev/shm, then remounts every other mount point read-only (all but the namespace's own /proc).
2. --uid: chowns the scratch dir and the connection file to uid:uid.
3. rlimits: AS, NPROC, FSIZE, NOFILE and CORE=0, soft and hard.
4. --uid: drops root for good (no groups, gid = uid, no-new-privileges).
5. chdir to the scratch dir, environment replaced by isolation.kernel_env.
6. the kernel: exec in place, or as PID 1 fork it and stay as its init (below); with --probe instead
   a one-line JSON report of which fences hold. With --template-warmup the kernel is `stare_sandbox.template`
   (user code in workers forked from a clean template, pool.clean_state: fork), else `ipykernel_launcher`.

PID 1: in a PID namespace the launcher stays as PID 1, a minimal init: it forks the kernel, reaps
every process orphaned in the namespace and exits with the kernel's status, which kills whatever is
left. The kernel is not PID 1 because PID 1 ignores all signals it has no handler for, so the
server's SIGTERM would be lost (see _init). The init costs one small interpreter per kernel. Without a
PID namespace the launcher execs the kernel in its own place.

Death of the server: the first process of the argv (`unshare`, or this launcher in process mode) runs
with the parent-death signal SIGKILL (isolation._die_with_parent). With namespaces, `unshare --kill-child`
gives PID 1 the same signal for unshare's death, step 4 keeps it across the change of uid, and PID 1's
death ends the namespace: nothing survives a server that is SIGKILLed or crashes. In process mode the
signal survives the exec into the kernel, which dies at once (ipykernel's parent poller, given the
server's pid, would end it within a second too); processes the kernel started may outlive it, and the
scratch dirs and cgroups of such a server stay behind, until the next owner of its uid range ends and
removes them (stare_sandbox.ownership).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from stare_sandbox.cgroups import KernelCgroup, find_cgroups, sweep_cgroups
from stare_sandbox.isolation import kernel_env

# <sys/mount.h>, <sched.h>, <sys/prctl.h>
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 14, 1 << 18, 1 << 21, 1 << 24
CLONE_NEWNS = 0x00020000
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 2, 38
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522  # <linux/capability.h>
_KEPT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

_RLIMITS = {  # flag -> (resource, bytes per unit)
    "memory_mb": (resource.RLIMIT_AS, 2**20),
    "processes": (resource.RLIMIT_NPROC, 1),
    "file_size_mb": (resource.RLIMIT_FSIZE, 2**20),
    "open_files": (resource.RLIMIT_NOFILE, 1),
}

_KERNEL_ARGS = ["--HistoryManager.enabled=False"]  # no history sqlite; the kernel writes only in the scratch dir


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    connection_file = Path(args.connection_file).absolute()
    scratch = connection_file.parent
    if not scratch.is_dir():
        raise SystemExit(f"stare_sandbox.launch: the connection file's directory {scratch} does not exist")
    if args.cgroup_group is not None:  # first: also what the remount below would make read-only
        _step("put the kernel in its own cgroup", _join_cgroup, scratch, args.cgroup_group, args.cgroup_memory_mb)
    if args.readonly_root:
        hide = args.drop_capabilities  # other kernels run as the same uid: their dirs would be readable
        _step("make the file system read-only", _readonly_root, scratch, args.file_size_mb, hide)
    if args.uid is not None:
        for path in (scratch, connection_file):
            if path.exists():
                _step(f"chown {path} to {args.uid}", os.chown, path, args.uid, args.uid)
    _step("set rlimits", _set_rlimits, args)
    if args.drop_capabilities:
        _step("drop every capability", _drop_capabilities)
    if args.uid is not None:
        _step(f"switch to uid {args.uid}", _drop_privileges, args.uid)
    os.chdir(scratch)
    env = kernel_env(scratch)
    os.environ.clear()
    os.environ.update(env)
    if args.probe:
        print(json.dumps(_probe_report(args, scratch)), flush=True)
        return 0
    if os.getpid() == 1:
        return _init(connection_file, env, args.template_warmup)
    # The parent-death signal set before this launcher started survives the exec; ipykernel's poll of its
    # parent is the second guard (and the only one where there is no prctl).
    kernel = _kernel_argv(connection_file, parent=os.getppid(), template_warmup=args.template_warmup)
    _step(f"start the kernel {sys.executable}", os.execve, sys.executable, kernel, env)
    return 1  # not reached: execve replaced this process


def _kernel_argv(connection_file: Path, parent: int, template_warmup: str | None = None) -> list[str]:
    parent_flag = f"--IPKernelApp.parent_handle={parent}"  # 1: no parent to watch
    kernel_args = ["-f", str(connection_file), parent_flag, *_KERNEL_ARGS]
    if template_warmup is not None:  # pool.clean_state: fork (stare_sandbox.template)
        return [sys.executable, "-m", "stare_sandbox.template", template_warmup, "--", *kernel_args]
    return [sys.executable, "-m", "ipykernel_launcher", *kernel_args]


def _init(connection_file: Path, env: dict[str, str], template_warmup: str | None = None) -> int:
    """PID 1 of the namespace: run the kernel as a child, reap every process, exit when the kernel does.

    The kernel must not be PID 1 itself: PID 1 ignores every signal it has no handler for, so the
    server's SIGTERM (jupyter_client's second shutdown step, needed when ipykernel 7 hangs in its own
    shutdown) would do nothing, and orphaned processes would stay zombies. Our exit kills the rest of
    the namespace. SIGINT and SIGTERM reach the kernel directly (jupyter_client signals the process
    group); init ignores them. After the fork this process execs `python -I -S` running _INIT, which
    keeps about 3 MB private instead of the launcher's 9 MB.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stays ignored across the exec
    kernel = os.fork()
    if kernel == 0:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execve(sys.executable, _kernel_argv(connection_file, parent=1, template_warmup=template_warmup), env)
        except OSError as e:
            print(f"stare_sandbox.launch: cannot start the kernel {sys.executable}: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", _INIT, str(kernel)], env)
    return 1  # not reached


_INIT = """
import os, sys
kernel = int(sys.argv[1])
while True:
    pid, status = os.waitpid(-1, 0)
    if pid == kernel:
        code = os.waitstatus_to_exitcode(status)
        sys.exit(code if code >= 0 else 128 - code)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stare_sandbox.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--memory-mb", type=int, required=True, help="RLIMIT_AS in MiB")
    parser.add_argument("--processes", type=int, required=True, help="RLIMIT_NPROC")
    parser.add_argument("--file-size-mb", type=int, required=True, help="RLIMIT_FSIZE in MiB")
    parser.add_argument("--open-files", type=int, required=True, help="RLIMIT_NOFILE")
    parser.add_argument("--uid", type=int, help="run the kernel as this uid and gid (needs root)")
    parser.add_argument("--cgroup-group", help="run the kernel in its own cgroup, in this group (its pool's)")
    parser.add_argument("--cgroup-memory-mb", type=int, default=4096, help="the memory limit of that cgroup, MiB")
    parser.add_argument(
        "--readonly-root", action="store_true", help="read-only file system outside the scratch dir (needs root)"
    )
    parser.add_argument(
        "--template-warmup",
        help="run the kernel as stare_sandbox.template with this warm-up code (encode_warmup): user code in workers",
    )
    parser.add_argument(
        "--drop-capabilities",
        action="store_true",
        help="in a user namespace (a server that is not root): drop every capability for good before the kernel "
        "starts, and hide the other kernels' scratch dirs (same uid) under an empty tmpfs",
    )
    parser.add_argument("--probe", action="store_true", help="set everything up, print a JSON report, exit 0")
    parser.add_argument("connection_file", help="the kernel's connection file, inside its scratch dir")
    return parser


def _step(what: str, func, *args) -> None:
    try:
        func(*args)
    except OSError as e:
        raise SystemExit(f"stare_sandbox.launch: cannot {what}: {e}") from e


# --- file system -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    _check(_libc().mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def _readonly_root(scratch: Path, shm_mb: int, hide_siblings: bool = False) -> None:
    # A mount namespace of our own even if unshare(1) already made one: these mounts must never reach
    # the host's mount table, whoever started this.
    _check(_libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    covered, uncovered = "", []
    if hide_siblings:  # before _expose: its tmpfs mounts under the scratch root would be covered too
        covered, uncovered = str(scratch.parent), _cover_all_but(scratch)
    _expose([*_interpreter_paths(), str(scratch)])  # first: its tmpfs would cover the scratch bind mount
    _mount(str(scratch), str(scratch), None, MS_BIND)
    keep = [str(scratch), "/proc"]
    if not _under(str(scratch), "/dev/shm"):
        # multiprocessing needs a writable /dev/shm; the host's would be a shared writable place
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={shm_mb}m")
        keep.append("/dev/shm")
    for mount_point, options in _mounts():
        if "ro" in options or any(_under(mount_point, k) for k in keep):
            continue
        hidden = covered and mount_point != covered and _under(mount_point, covered)
        if hidden and not any(_under(mount_point, k) for k in uncovered):
            continue  # under the tmpfs over the scratch root: out of reach, and no longer a mount point there
        if _unreachable(mount_point):
            continue  # behind a directory this user may not search: out of the kernel's reach, and of mount's
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name in options:
            flags |= _KEPT_FLAGS.get(name, 0)
        _mount(None, mount_point, None, flags)


def _cover_all_but(scratch: Path) -> list[str]:
    """An empty tmpfs over the scratch root, with only this kernel's scratch dir bound back into it, and what the
    interpreter reads when it lies there too (a virtual environment in $TMPDIR, say); returns the paths bound back."""
    parent = str(scratch.parent)
    kept = [str(scratch), *(p for p in _interpreter_paths() if _under(p, parent) and p != parent)]
    _cover(parent, kept)
    return kept


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of the visible mounts in /proc/self/mountinfo, parents first.

    A mount stacked on another at the same point comes later in the file and hides the earlier one,
    which no path reaches any more; only the top one is listed.
    """
    mounts: dict[str, set[str]] = {}
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            mounts.pop(point, None)  # re-insert, so the order stays that of the top mounts
            mounts[point] = set(fields[5].split(","))
    return list(mounts.items())


def _unreachable(path: str) -> bool:
    """Whether `path` cannot be looked up: a directory on the way is not searchable by this process (not root, in a
    user namespace, under another user's 0700 directory: podman's storage mounts under /var/lib/containers, say).
    Remounting it fails for that reason, and the kernel's code, with no capabilities, cannot reach it either."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:  # gone meanwhile, say: not this case
        pass
    return False


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _interpreter_paths() -> list[str]:
    """What the kernel's interpreter reads: its binary, prefixes and import path (not the cwd entry)."""
    paths = {sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path[1:]}
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def _expose(paths: list[str]) -> None:
    """Make each path reachable by an unprivileged uid without opening anything else.

    A directory on the way that others may not enter (e.g. /root, mode 0700, holding a pyenv Python)
    is covered by an empty tmpfs, and only the entries leading to the paths are bound back into it.
    Without this the kernel uid cannot exec the interpreter, or worse, Python silently falls back to
    another installation's standard library.
    """
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).parts
        for i in range(1, len(parts)):
            directory = os.path.join(*parts[:i])
            if not os.stat(directory).st_mode & 0o001:
                blocked.setdefault(directory, set()).add(parts[i])
    for directory in sorted(blocked, key=lambda d: len(Path(d).parts)):  # outer ones first
        _cover(directory, [os.path.join(directory, name) for name in sorted(blocked[directory])])


def _cover(directory: str, kept: list[str]) -> None:
    """An empty tmpfs over `directory`, with the paths `kept` under it (any depth) bound back into it: each is
    opened before it is covered and bound back from its open descriptor, parents first."""
    fds = {path: os.open(path, os.O_PATH) for path in sorted(set(kept), key=len)}
    _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
    for path, fd in fds.items():
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


# --- process -----------------------------------------------------------------------------------------


def _join_cgroup(scratch: Path, group: str, memory_mb: int) -> None:
    cgroups = find_cgroups()
    if isinstance(cgroups, str):
        raise OSError(f"no cgroups here: {cgroups}")
    sweep_cgroups(cgroups, group, scratch.parent)
    KernelCgroup(cgroups, group, scratch.name).join(memory_mb * 2**20)


def _set_rlimits(args: argparse.Namespace) -> None:
    for flag, (which, unit) in _RLIMITS.items():
        value = getattr(args, flag) * unit
        resource.setrlimit(which, (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop_capabilities() -> None:
    """No capability left, now or after any exec: the bounding and ambient sets emptied, then the effective,
    permitted and inheritable ones (capset), and no-new-privileges. Root in a user namespace keeps its uid (the only
    one mapped), so this is what stops the kernel from remounting the file system writable or making namespaces."""
    libc = _libc()
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two 32-bit halves of effective, permitted, inheritable: all 0
    _check(libc.capset(header, data), "capset(0)")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _no_capabilities() -> bool:
    """Every capability set of this process is empty (/proc/self/status)."""
    with open("/proc/self/status") as status:
        sets = dict(line.split(":", 1) for line in status if line.startswith("Cap"))
    return all(int(value, 16) == 0 for value in sets.values())


def _drop_privileges(uid: int) -> None:
    parent_death = ctypes.c_int(0)
    _check(_libc().prctl(PR_GET_PDEATHSIG, ctypes.addressof(parent_death), 0, 0, 0), "prctl(PR_GET_PDEATHSIG)")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid or os.getgroups():
        raise OSError(f"still uid {os.getuid()}/{os.geteuid()}, gid {os.getgid()}, groups {os.getgroups()}")
    # setuid binaries (mount, su) must not give root back
    _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # changing uid clears the parent-death signal that `unshare --kill-child` set; set it again
    if parent_death.value:
        _check(_libc().prctl(PR_SET_PDEATHSIG, parent_death.value, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


# --- probe -------------------------------------------------------------------------------------------


def _probe_report(args: argparse.Namespace, scratch: Path) -> dict[str, bool]:
    """Which fences hold, checked from inside; isolation.detect_isolation wants all True."""
    report = {
        "pid_namespace": os.getpid() == 1,
        "network": _network_is_off(),
        "readonly_root": args.readonly_root and _all_readonly(scratch),
        "unprivileged_user": (
            _no_capabilities()
            if args.drop_capabilities
            else args.uid is not None and os.getuid() == args.uid and os.geteuid() == args.uid
        ),  # fmt: skip
        "rlimits": all(resource.getrlimit(r) == (getattr(args, f) * u,) * 2 for f, (r, u) in _RLIMITS.items()),
        "scratch_writable": _can_write(scratch / "probe-write"),
        "outside_readonly": not _can_write(Path("/tmp") / f"sandbox-probe-{os.getpid()}-{args.uid}"),
        "interpreter": _interpreter_works(),
    }
    return report


def _network_is_off() -> bool:
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        return False
    for family, kind, address in [
        (socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 9)),
        (socket.AF_INET, socket.SOCK_DGRAM, ("1.1.1.1", 53)),
    ]:
        with socket.socket(family, kind) as sock:
            sock.settimeout(2)
            try:
                sock.connect(address)
                return False
            except OSError:
                pass
    return True


def _all_readonly(scratch: Path) -> bool:
    keep = [str(scratch), "/proc", "/dev/shm"]
    reachable = [(point, options) for point, options in _mounts() if not _unreachable(point)]
    return all("ro" in options for point, options in reachable if not any(_under(point, k) for k in keep))


def _can_write(path: Path) -> bool:
    try:
        path.write_text("x")
        path.unlink()
        return True
    except OSError:
        return False


def _interpreter_works() -> bool:
    """The interpreter runs as the kernel uid with its own standard library and finds ipykernel."""
    code = (
        "import importlib.util, json, sys\n"
        "found = bool(importlib.util.find_spec('ipykernel'))\n"
        "print(json.dumps([sys.base_prefix, found]))"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
        return json.loads(done.stdout) == [sys.base_prefix, True]
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
