"""The built-in (in-engine) sandbox when the job is not root, as on a cluster where Ray runs as the user.

The suite runs as root; these tests switch to a uid of their own (as_user.py) that holds THREADS other threads,
more than a kernel's RLIMIT_NPROC of 64, as a node running engines and DeepSpeed ranks as one user does. Where the
host allows unprivileged user namespaces (it does here and in CI), every kernel runs in its own user, PID, network
and mount namespaces with no capabilities: tool calls work, RLIMIT_NPROC counts the kernel's own processes, and a
write outside the kernel's scratch dir fails. Where the host forbids them, the run refuses to start with one line
that points to the sandbox service (the last test makes the probe fail to show it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stare_agent.config import SandboxConfig
from stare_agent.runtime import SandboxBroken, check_sandbox

HERE = Path(__file__).parent
UID = 58123  # no passwd entry needed; outside the kernel uid ranges (61000-99999)

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"),
                                reason="switches to another uid: needs root on Linux")  # fmt: skip


def host_allows_user_namespaces() -> bool:
    """Whether UID may make the namespaces a kernel gets (util-linux setpriv and unshare)."""
    user = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"]
    unshare = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--ipc", "--fork", "--mount", "true"]
    return subprocess.run([*user, *unshare], capture_output=True, timeout=60).returncode == 0


def run_as_user(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[dict, Path]:
    home = tmp_path / "user"
    run_folder = home / "run"  # stands in for the run folder: the job's user owns it and may write it
    run_folder.mkdir(parents=True)
    for path in (home, run_folder):
        os.chown(path, UID, UID)
    tmp_path.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home), **(env or {})}
    argv = [sys.executable, str(HERE / "as_user.py"), str(UID), str(HERE / "in_engine_as_user.py"), str(run_folder)]
    done = subprocess.run(argv, env=env, cwd=home, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), run_folder


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed")
def test_tool_calls_work_and_stay_in_their_scratch_dir_as_a_user_with_many_threads(tmp_path):
    # A mount point the user cannot reach (behind a directory only root may search), as podman's storage mounts under
    # /var/lib/containers are while containers run: the launcher cannot remount it read-only, and need not.
    locked = Path(tempfile.mkdtemp(prefix="stare-locked-", dir="/var/tmp"))  # 0700, root's; not under tmp_path,
    (locked / "mounted").mkdir()  # which as_user.py covers with a tmpfs (a 0700 directory of root's)
    try:
        report, run_folder = run_as_user(tmp_path, {"AS_USER_BIND": str(locked / "mounted")})
    finally:
        shutil.rmtree(locked)
    assert report["uid"] == UID and report["threads_held"] >= 100
    if not host_allows_user_namespaces():  # then the refusal is what a user sees
        assert not report["started"] and "sandbox service" in report["check_sandbox"], report
        return
    assert report["started"], report
    isolation = report["isolation"]
    assert isolation["mode"] == "namespaces" and isolation["user_namespace"] and isolation["readonly_root"]
    assert report["check_sandbox"] == "ok"  # what each engine runs at its start
    assert report["answer"] == {"status": "ok", "stdout": "42", "error": "None"}
    assert report["threads"]["stdout"] == "threads ok"  # 8 more threads under RLIMIT_NPROC 64, beside 100 held
    assert report["run_folder"]["status"] == "error" and "Read-only file system" in report["run_folder"]["error"]
    assert not (run_folder / "policy.txt").exists()
    assert report["scratch"]["stdout"] == "x"  # the scratch dir stays writable
    assert report["siblings"]["stdout"] == "True"  # the other kernels' dirs (same uid) are out of sight
    assert report["signal"]["stdout"] == "ProcessLookupError"  # the job's processes are out of sight
    assert report["capabilities"]["stdout"] == "0000000000000000"
    assert report["remount"]["status"] == "ok" and report["remount"]["stdout"] != "0"  # mount refuses


def test_a_host_without_user_namespaces_refuses_the_built_in_sandbox_in_one_line(monkeypatch):
    """As a user that is not root, with the namespace probe failing as it does where the host forbids user
    namespaces: check_sandbox (each engine's start) says why and points to the sandbox service."""
    from stare_sandbox import isolation

    monkeypatch.setattr(os, "geteuid", lambda: UID)
    monkeypatch.setattr(isolation, "_namespace_problem", lambda: "user.max_user_namespaces=0 (a test)")
    with pytest.raises(SandboxBroken) as refused:
        check_sandbox(SandboxConfig(pool_size=1))
    message = str(refused.value)
    assert "in-process kernels (uid 58123)" in message and "user.max_user_namespaces=0 (a test)" in message
    assert "run the sandbox service (`stare-agent sandbox serve`" in message and "\n" not in message
