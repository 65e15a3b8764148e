"""Which kernel pool owns which kernel uid range on this host, and taking over what a dead owner left.

A kernel pool (the server's, or one inside a trainer) claims one range of RANGE_SIZE kernel uids for its
whole life: an exclusive flock on `<state dir>/uids-<first>-<last>.lock`, held until the pool closes. The
operating system drops the lock when its process dies, however it dies, so no two live pools on one host
ever hold the same range: namespace kernels of two servers never share a uid (nor RLIMIT_NPROC), and a
pool may kill whatever runs under its own range's uids. Process-mode pools claim a range too: it names
what they leave behind.

Ranges start at UID_BASE and step by RANGE_SIZE up to 99999 (below the usual /etc/subuid ranges), all but
65000-65999, which holds nobody (65534) and the invalid 65535, and any range holding the uid of a user the
host knows (`pwd.getpwall()`): kernels never run as a real user, and a reclaim never kills a real user's
processes. `uid_base=0` takes the first free range; an explicit `uid_base` that another pool holds (or that
holds a user's uid) is refused with an error naming the range and the holder's pid (or the user): a server
must not run its kernels under other uids than it was told (a deployment may rely on them).

The lock file records what its owner leaves behind if it dies without its clean-up (SIGKILL, a crash): its
pid, its scratch root and its cgroups. The next pool to claim the range reclaims it (`Owner.reclaim`) before
starting a kernel: it kills the processes of the range's uids (namespace kernels), those in the
predecessor's kernel cgroups, and those of its own uid whose HOME is one of the predecessor's scratch dirs
(what process-mode kernels started); then it removes the predecessor's scratch dirs (its whole scratch root
if the predecessor made that root) and its kernel cgroups. A clean close removes the lock file.

State dir: $SANDBOX_STATE_DIR if set, else /run/stare-sandbox for root where /run is writable, else
<temp dir>/stare-sandbox-<euid>. Pools exclude each other only through a shared state dir (containers on one
host: bind-mount it). It must be a directory of ours that nobody else may write, since what it records gets
killed and removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import stat
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from stare_sandbox.cgroups import Cgroups, range_group, sweep_cgroups
from stare_sandbox.isolation import UID_BASE, UID_RANGE_SIZE, remove_scratch, scratch_prefix
from stare_sandbox.processes import kill_processes_with_home, kill_uid_processes

__all__ = [
    "AUTO_UID_BASES",
    "RANGE_SIZE",
    "Owner",
    "RangeTaken",
    "StateDirError",
    "check_claimable",
    "check_uid_base",
    "claim_uid_range",
    "free_of_users",
    "state_dir",
]

RANGE_SIZE = UID_RANGE_SIZE
AUTO_UID_BASES = tuple(b for b in range(UID_BASE, 100_000, RANGE_SIZE) if not b <= 65534 < b + RANGE_SIZE)
"""The first uid of every range, in the order uid_base=0 tries them."""


STATE_DIR_ENV = "SANDBOX_STATE_DIR"
RUN_DIR = Path("/run")


class RangeTaken(RuntimeError):
    """The uid range asked for, or every range, is held by another live pool (or holds a real user's uid)."""


class StateDirError(RuntimeError):
    """The state dir cannot be made, or is not safely ours."""


def check_uid_base(uid_base: int, max_kernels: int) -> None:
    """ValueError unless `uid_base` names a range (or is 0) and `max_kernels` uids fit in one."""
    if uid_base != 0 and uid_base not in AUTO_UID_BASES:
        raise ValueError(
            f"uid_base must be 0 (the first free range) or the first uid of a range: {AUTO_UID_BASES[0]}, "
            f"{AUTO_UID_BASES[1]}, ... {AUTO_UID_BASES[-1]} in steps of {RANGE_SIZE}, except 65000; got {uid_base}"
        )
    if max_kernels > RANGE_SIZE:
        raise ValueError(f"max_kernels must be <= {RANGE_SIZE}, the uids of one range; got {max_kernels}")


def state_dir() -> Path:
    """Where the range locks live: $SANDBOX_STATE_DIR, else /run/stare-sandbox for root where /run is writable
    (a container's may not be), else <temp dir>/stare-sandbox-<euid>."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    if os.geteuid() == 0 and os.access(RUN_DIR, os.W_OK):
        return RUN_DIR / "stare-sandbox"
    return _temp_state_dir()


def _temp_state_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"stare-sandbox-{os.geteuid()}"


def free_of_users(bases: Collection[int], user_uids: Collection[int]) -> list[int]:
    """The ranges (by first uid) of `bases` that hold none of `user_uids` (the host's users: `pwd.getpwall()`)."""
    return [first for first in bases if not any(first <= uid < first + RANGE_SIZE for uid in user_uids)]


def _bases(uid_base: int) -> list[int]:
    """The ranges `claim_uid_range(uid_base)` may take, in order; RangeTaken if `uid_base` holds a user's uid."""
    users = {entry.pw_uid: entry.pw_name for entry in pwd.getpwall()}
    if uid_base == 0:
        return free_of_users(AUTO_UID_BASES, users)
    if not free_of_users([uid_base], users):
        uid = min(u for u in users if uid_base <= u < uid_base + RANGE_SIZE)
        raise RangeTaken(
            f"kernel uids {uid_base}-{uid_base + RANGE_SIZE - 1} include uid {uid} of user {users[uid]!r}: kernels "
            "must not run as a real user (nor a reclaim kill its processes); choose another uid_base (--uid-base), "
            "or 0 for the first free range"
        )
    return [uid_base]


@dataclass
class Reclaimed:
    """What a pool found of its range's previous owner and removed."""

    previous_pid: int | None
    processes: int
    scratch_dirs: int
    by_record: int
    """Of `processes`, those found from the dead owner's record (in its cgroups, by their HOME); the others ran
    under the range's uids."""

    def __str__(self) -> str:
        return (
            f"killed {self.processes} processes left by pid {self.previous_pid} or running under the range's uids, "
            f"removed {self.scratch_dirs} of its scratch dirs"
        )


class Owner:
    """A claimed uid range: the lock, held until `release`, and the record of what this pool leaves behind."""

    def __init__(self, first: int, path: Path, fd: int, previous: dict, *, remove_dir: bool = False):
        self.first = first
        self.path = path
        self._remove_dir = remove_dir  # the per-user state dir in the temp dir goes when empty; /run's stays
        self._fd: int | None = fd
        self.previous = previous
        """What the range's previous owner recorded (empty if it closed cleanly, or there was none)."""
        # kept in our record until reclaimed, so a successor of ours still finds it should we die before that
        self._record: dict = {"pid": os.getpid(), "uids": [first, self.last], "unreclaimed": previous or None}
        self._write()

    @property
    def last(self) -> int:
        return self.first + RANGE_SIZE - 1

    @property
    def uids(self) -> range:
        return range(self.first, self.first + RANGE_SIZE)

    def slots(self, count: int) -> list[int]:
        """The pool's first `count` kernel slots: offsets from UID_BASE, so a kernel's uid is UID_BASE + slot."""
        return [self.first - UID_BASE + i for i in range(count)]

    def record(self, *, scratch_root: Path, owns_root: bool, cgroups: Cgroups | None) -> None:
        """Note where this pool makes scratch dirs and cgroups, for a successor should it die without clean-up."""
        self._record.update(
            scratch_root=str(scratch_root), owns_root=owns_root, cgroups=cgroups.as_dict() if cgroups else None
        )
        self._write()

    def _write(self) -> None:
        assert self._fd is not None, "the range was released"
        data = json.dumps(self._record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def reclaim(self) -> Reclaimed:
        """End and remove what the previous owner left (see the module docstring). Call before starting kernels."""
        previous = self.previous
        # Only a record means an owner died here without its clean-up; only root runs kernels under these uids.
        processes = kill_uid_processes(self.uids) if previous and os.geteuid() == 0 else 0
        by_record = scratch_dirs = 0
        record = previous
        while record:  # the previous owner's, then what it had not reclaimed yet itself when it died
            killed, removed = self._reclaim_one(record)
            by_record += killed
            scratch_dirs += removed
            record = record.get("unreclaimed") if isinstance(record.get("unreclaimed"), dict) else None
        self._record["unreclaimed"] = None
        self._write()
        pid = previous.get("pid") if isinstance(previous.get("pid"), int) else None
        return Reclaimed(pid, processes + by_record, scratch_dirs, by_record)

    def _reclaim_one(self, record: dict) -> tuple[int, int]:
        """(processes killed in its cgroups or by HOME, scratch dirs removed) for one dead owner's record."""
        killed = removed = 0
        if record.get("cgroups"):
            killed += sweep_cgroups(Cgroups.from_dict(record["cgroups"]), range_group(self.first))
        root = Path(record["scratch_root"]) if record.get("scratch_root") else None
        pid = record.get("pid")
        if root is not None and isinstance(pid, int):
            prefix = scratch_prefix(pid)
            killed += kill_processes_with_home(f"{root}/{prefix}")
            with contextlib.suppress(FileNotFoundError):
                for leftover in root.glob(f"{prefix}*"):
                    remove_scratch(leftover)
                    removed += 1
            # the dead owner's own root is removed whole, but only a root named as pools name theirs
            if record.get("owns_root") and root.name.startswith("sandbox-"):
                remove_scratch(root)
        return killed, removed

    def release(self) -> None:
        """Remove the lock file and drop the lock (a clean close leaves nothing to reclaim). Idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        os.close(self._fd)  # drops the flock
        self._fd = None
        if self._remove_dir:
            with contextlib.suppress(OSError):  # not empty: another pool holds a range
                self.path.parent.rmdir()


def claim_uid_range(uid_base: int = 0, max_kernels: int = RANGE_SIZE, directory: Path | None = None) -> Owner:
    """Lock the range starting at `uid_base`, or with 0 the first free one; RangeTaken if none can be had.

    The caller holds the range until `Owner.release` or its death; it should `reclaim` before starting kernels.
    """
    check_uid_base(uid_base, max_kernels)
    directory = state_dir() if directory is None else Path(directory)
    remove_dir = directory == _temp_state_dir()  # ours alone; /run's and one named by $SANDBOX_STATE_DIR stay
    for first in _bases(uid_base):
        path = _lock_path(directory, first)
        fd = _lock(path)
        if fd is None:
            continue
        try:
            previous = json.loads(os.pread(fd, 1 << 20, 0) or b"{}")
        except json.JSONDecodeError:
            previous = {}  # a predecessor killed while it wrote: nothing to go by but the uids
        return Owner(first, path, fd, previous if isinstance(previous, dict) else {}, remove_dir=remove_dir)
    raise _taken(uid_base, directory)


def check_claimable(uid_base: int = 0, max_kernels: int = RANGE_SIZE, directory: Path | None = None) -> None:
    """RangeTaken (or ValueError) now if `claim_uid_range` would fail; for a command line to say so before it
    starts anything. Claims nothing and leaves a dead owner's record for the pool that will reclaim it."""
    check_uid_base(uid_base, max_kernels)
    directory = state_dir() if directory is None else Path(directory)
    for first in _bases(uid_base):
        fd = _lock(_lock_path(directory, first))
        if fd is not None:
            os.close(fd)
            return
    raise _taken(uid_base, directory)


def _lock_path(directory: Path, first: int) -> Path:
    return directory / f"uids-{first}-{first + RANGE_SIZE - 1}.lock"


def _taken(uid_base: int, directory: Path) -> RangeTaken:
    if uid_base:
        path = _lock_path(directory, uid_base)
        return RangeTaken(
            f"kernel uids {uid_base}-{uid_base + RANGE_SIZE - 1} are held by another sandbox (pid {_holder(path)}, "
            f"lock {path}); stop that one, choose another uid_base (--uid-base), or 0 for the first free range"
        )
    return RangeTaken(
        f"every kernel uid range without a host user's uid is held by another sandbox (locks in {directory}); "
        "stop one of them"
    )


def _lock(path: Path) -> int | None:
    """An open descriptor of `path` holding its exclusive flock, or None if another holds it."""
    while True:
        _private_dir(path.parent)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # the dir was just removed by a pool releasing the last range in it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)  # its owner removed the file between our open and our lock: lock the new one


def _holder(path: Path) -> str:
    try:
        pid = json.loads(path.read_bytes()).get("pid")
    except (OSError, ValueError, AttributeError):
        pid = None
    return str(pid) if isinstance(pid, int) else "unknown"


def _private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as e:
        raise StateDirError(
            f"cannot make the sandbox state dir {path}, where kernel uid ranges are locked: {e}; "
            f"set {STATE_DIR_ENV} to a directory this user may create"
        ) from e
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise StateDirError(
            f"the sandbox state dir {path} must be a directory owned by uid {os.geteuid()} that no one else may "
            "write (what it records gets killed and removed); remove it and start again"
        )
