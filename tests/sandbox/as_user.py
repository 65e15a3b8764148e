"""Run a Python file as another uid, with this interpreter and this checkout reachable by it (a test helper).

    python tests/sandbox/as_user.py UID SCRIPT [ARGS...]     # as root

$AS_USER_BIND: paths (separated by ":") bind-mounted onto themselves in that mount namespace first, e.g. a mount
point behind a directory only root may search, as podman's storage mounts under /var/lib/containers are.

The suite runs as root, with an interpreter that may sit under a directory only root may enter (/root, mode 0700)
and a checkout that may too (a 0700 temporary dir). This makes its own mount namespace, covers each such
directory with an empty tmpfs into which only the paths needed are bound back (stare_sandbox.launch does the same
for its kernels), switches to UID for good, and runs SCRIPT with this interpreter. Nothing changes outside the
namespace.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from stare_sandbox import launch

CLONE_NEWNS = 0x00020000


def main() -> None:
    uid, script, *args = sys.argv[1:]
    uid = int(uid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise SystemExit(f"as_user: unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
    launch._mount(None, "/", None, launch.MS_REC | launch.MS_PRIVATE)
    for path in filter(None, os.environ.pop("AS_USER_BIND", "").split(":")):
        launch._mount(path, path, None, launch.MS_BIND)
    needed = [*launch._interpreter_paths(), str(Path(script).resolve().parent), str(Path.cwd())]
    launch._expose(sorted({os.path.realpath(p) for p in needed}))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.execv(sys.executable, [sys.executable, script, *args])


if __name__ == "__main__":
    main()
