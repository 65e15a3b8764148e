"""Kernel uid ranges and recovery after a server killed without its clean-up (stare_sandbox.ownership).

Real servers (`python -m stare_sandbox serve` on a free loopback port), real kernels, real SIGKILL. A server's
range is read from the lock file it holds (its record names its pid). The servers' temp dir is the test's
own, so the scratch root a server makes lies there; range locks stay in the host's state dir, shared with
every other sandbox on the machine, as in production: tests never assume which range is free.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import _stat, alive, descendants  # tests/procs.py

import stare_sandbox.ownership as ownership
from stare_sandbox.cgroups import range_group, usable_cgroups
from stare_sandbox.isolation import UID_BASE, detect_isolation, make_scratch
from stare_sandbox.ownership import (
    AUTO_UID_BASES,
    RANGE_SIZE,
    RangeTaken,
    check_uid_base,
    claim_uid_range,
    free_of_users,
    state_dir,
)

REPO = Path(__file__).resolve().parents[2]
START_S = 180  # a server start includes the isolation probe and warm kernels; slow on a loaded machine

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m stare_sandbox serve` with a small pool, in a subprocess whose temp dir is `tmp`."""

    def __init__(self, tmp: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(self.port), "--pool-size", "1"]
        argv += ["--max-kernels", "8", "--max-sessions", "8", *args]
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TMPDIR": str(tmp)}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if self.http.get("/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"server did not become healthy in {START_S} s")

    def uid_base(self) -> int:
        """The first uid of the range this server holds, from the record in its lock file."""
        for path in state_dir().glob("uids-*.lock"):
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(path.read_text())
                if record.get("pid") == self.proc.pid:
                    return record["uids"][0]
        raise AssertionError(f"no lock file in {state_dir()} records pid {self.proc.pid}")

    def session(self) -> str:
        response = self.http.post("/v1/sessions")
        assert response.status_code == 201, response.text
        return response.json()["session_id"]

    def run(self, code: str, session: str | None = None, timeout_s: float = 60) -> dict:
        path = f"/v1/sessions/{session}/execute" if session else "/v1/execute"
        response = self.http.post(path, json={"code": code, "timeout_s": timeout_s})
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # at once: SIGTERM drains, waiting for open sessions
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()


@contextlib.contextmanager
def running(tmp: Path, *args: str) -> Iterator[Server]:
    server = Server(tmp, *args)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: kernels' IPC socket paths under it must fit in 108 bytes (sun_path)."""
    path = Path(tempfile.mkdtemp(prefix="rec-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def isolation_or_skip(mode: str) -> str:
    if mode == "namespaces" and detect_isolation("auto").mode != "namespaces":
        pytest.skip("namespace isolation is not available here (needs root and util-linux unshare)")
    return mode


def cgroups_in(directory: Path) -> set[str]:
    """The names of the cgroups in a cgroup dir (its subdirs; the files are its controls)."""
    return {entry.name for entry in os.scandir(directory) if entry.is_dir()} if directory.exists() else set()


def pids_with_uid_in(uids: range) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid in uids and _stat(int(entry))[1] != "Z":
                found.append(int(entry))
    return found


# --- values ------------------------------------------------------------------------------------------


def test_uid_base_must_name_a_range():
    check_uid_base(0, 64)
    check_uid_base(AUTO_UID_BASES[1], RANGE_SIZE)
    with pytest.raises(ValueError, match=r"uid_base must be 0 \(the first free range\) or .*; got 61500"):
        check_uid_base(61500, 64)
    with pytest.raises(ValueError, match="got 65000"):  # holds nobody (65534)
        check_uid_base(65000, 64)
    with pytest.raises(ValueError, match=f"max_kernels must be <= {RANGE_SIZE}"):
        check_uid_base(0, RANGE_SIZE + 1)


def test_ranges_holding_a_host_users_uid_are_never_claimed(tmp_path, monkeypatch):
    assert free_of_users([61000, 62000, 63000, 64000], {0, 61999, 63000, 65534}) == [62000, 64000]
    # a host whose passwd has a user in the first range (faked: this host's users are its own)
    user = pwd.struct_passwd(("builder", "x", AUTO_UID_BASES[0] + 5, 100, "", "/home/builder", "/bin/sh"))
    monkeypatch.setattr(ownership.pwd, "getpwall", lambda: [user])
    owner = claim_uid_range(0, 8, directory=tmp_path)
    try:
        assert owner.first == AUTO_UID_BASES[1]
    finally:
        owner.release()
    with pytest.raises(RangeTaken, match=f"include uid {AUTO_UID_BASES[0] + 5} of user 'builder'"):
        claim_uid_range(AUTO_UID_BASES[0], 8, directory=tmp_path)


def test_the_state_dir_falls_back_to_the_temp_dir_and_may_be_named(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_STATE_DIR", raising=False)
    monkeypatch.setattr(ownership, "RUN_DIR", tmp_path / "no-run")  # /run missing or read-only
    assert state_dir() == Path(tempfile.gettempdir()) / f"stare-sandbox-{os.geteuid()}"
    monkeypatch.setenv("SANDBOX_STATE_DIR", str(tmp_path / "state"))
    owner = claim_uid_range(0, 8)
    try:
        assert owner.path.parent == tmp_path / "state"
    finally:
        owner.release()


def test_an_unusable_state_dir_stops_the_server_with_one_line():
    env = {**os.environ, "SANDBOX_STATE_DIR": "/dev/null/state"}
    argv = [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(free_port())]
    # the timeout only ends a server that started after all
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=START_S)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert (
        out.stderr.startswith("sandbox: cannot make the sandbox state dir /dev/null/state")
        and "SANDBOX_STATE_DIR" in out.stderr
    )


def test_claims_in_one_process_are_exclusive_and_a_release_frees_the_range(tmp_path):
    first = claim_uid_range(0, 8, directory=tmp_path)
    second = claim_uid_range(0, 8, directory=tmp_path)
    try:
        assert (first.first, second.first) == AUTO_UID_BASES[:2]
        assert [UID_BASE + slot for slot in second.slots(3)] == [second.first, second.first + 1, second.first + 2]
        held = rf"kernel uids {first.first}-{first.last} are held by another sandbox \(pid {os.getpid()}"
        with pytest.raises(RangeTaken, match=held):
            claim_uid_range(first.first, 8, directory=tmp_path)
        first.release()
        assert not first.path.exists()
        again = claim_uid_range(0, 8, directory=tmp_path)
        assert again.first == first.first and again.previous == {}  # released cleanly: nothing to reclaim
        again.release()
    finally:
        first.release()
        second.release()


def test_a_successor_also_reclaims_what_a_dead_owner_had_not_reclaimed_yet(tmp_path):
    """Owners die (their lock descriptor closed, as the OS does for a dead process) with their records left."""
    held = claim_uid_range()  # a range of the host's, so that the uid kill of reclaim() can only hit ours
    try:
        state, root = tmp_path / "state", tmp_path / "sandbox-root"
        leftover = make_scratch(root, uid=None)
        (leftover / "data").write_text("x")
        first = claim_uid_range(held.first, 8, directory=state)
        first.record(scratch_root=root, owns_root=True, cgroups=None)
        os.close(first._fd)  # dies with kernels' scratch dirs on disk
        second = claim_uid_range(held.first, 8, directory=state)
        assert second.previous["scratch_root"] == str(root)
        os.close(second._fd)  # dies before its reclaim()
        third = claim_uid_range(held.first, 8, directory=state)
        assert leftover.exists()
        reclaimed = third.reclaim()
        assert not root.exists() and reclaimed.scratch_dirs == 1
        third.release()
        assert list(state.iterdir()) == []
    finally:
        held.release()


# --- servers -----------------------------------------------------------------------------------------


def test_two_servers_get_disjoint_ranges_and_a_held_range_is_refused(short_tmp):
    with running(short_tmp / "a") as a, running(short_tmp / "b") as b:
        first_a, first_b = a.uid_base(), b.uid_base()
        assert first_a != first_b and {first_a, first_b} <= set(AUTO_UID_BASES)
        # both serve, each on its own kernels, which run as uids of its own range where they get their own uid
        uid_a, uid_b = (int(server.run("import os; print(os.getuid())")["stdout"]) for server in (a, b))
        if detect_isolation("auto").unprivileged_user:
            assert uid_a in range(first_a, first_a + 8) and uid_b in range(first_b, first_b + 8)
        refused = subprocess.run(
            [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(free_port()), "--uid-base", str(first_a)],
            cwd=REPO,
            env={**os.environ, "TMPDIR": str(short_tmp)},
            capture_output=True,
            text=True,
            timeout=START_S,
        )
        assert refused.returncode != 0
        assert f"kernel uids {first_a}-{first_a + RANGE_SIZE - 1} are held" in refused.stderr
        assert f"pid {a.proc.pid}" in refused.stderr
        assert a.run("print('still mine')")["stdout"] == "still mine\n"
    # stopped cleanly: their lock files are gone
    assert not (state_dir() / f"uids-{first_a}-{first_a + RANGE_SIZE - 1}.lock").exists()


def run_until_killed(server: Server, code: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        server.run(f"from time import sleep\n{code}", timeout_s=120)


# What a session starts and leaves running: it outlives the kernel (own session), so only recovery ends it.
# With `env`, it drops the kernel's environment (and HOME with it): then only the kernel's cgroup tells it apart.
LEAVE_A_PROCESS = """
import subprocess
child = subprocess.Popen(["sleep", "600"], start_new_session=True, env={env})
print(child.pid)
"""


@pytest.mark.parametrize(
    ("isolation", "flags"),
    [
        pytest.param("namespaces", (), id="namespaces"),
        pytest.param("process", (), id="process"),
        pytest.param("process", ("--no-cgroups",), id="process-no-cgroups"),
    ],
)
def test_restart_reclaims_what_a_killed_server_left(short_tmp, isolation, flags):
    """SIGKILL a server with sessions, files and a running call; the next server of its uid range ends the
    processes it left (by uid, cgroup, or HOME) and removes its scratch dirs and cgroups."""
    isolation_or_skip(isolation)
    tmp = short_tmp
    server = Server(tmp, "--isolation", isolation, *flags).wait_healthy()
    planted: dict[int, int] = {}  # pid -> start time of processes the server's death leaves running
    reap: list[subprocess.Popen] = []
    try:
        first = server.uid_base()
        uids = range(first, first + RANGE_SIZE)
        sessions = [server.session() for _ in range(3)]
        for i, sid in enumerate(sessions):
            assert server.run(f"open('data-{i}.txt', 'w').write('x' * 100_000)", sid)["status"] == "ok"
        if isolation == "process":
            env = {"PATH": "/usr/bin:/bin"} if usable_cgroups() is not None and not flags else None
            started = server.run(LEAVE_A_PROCESS.format(env=env), sessions[0])
            assert started["status"] == "ok", started
            orphan = int(started["stdout"])
            planted[orphan] = _stat(orphan)[2]
        else:
            # namespace kernels die with their namespace; a process of the range's uid that survived all the
            # same (see isolation: "Not isolated") is what recovery must end
            uid = first + 7
            setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "600"]
            leftover = subprocess.Popen(setpriv, start_new_session=True)
            planted[leftover.pid] = _stat(leftover.pid)[2]
            reap.append(leftover)
        roots = list(tmp.glob("sandbox-*"))
        assert len(roots) == 1, roots
        root = roots[0]
        # a call still running when the server dies
        busy = threading.Thread(target=run_until_killed, args=(server, "open('running', 'w').close(); sleep(600)"))
        busy.start()
        deadline = time.monotonic() + START_S
        while not list(root.glob("kernel-*/running")):
            assert time.monotonic() < deadline, "the stateless call did not start"
            time.sleep(0.05)
        server.proc.kill()
        server.proc.wait()
        busy.join()
        # what it left behind: its scratch dirs, its kernel cgroups, the planted process
        assert [p for p in root.glob("kernel-*") if (p / "data-0.txt").exists()] != []
        assert alive(planted) == list(planted)
        cgroups = usable_cgroups() if not flags else None
        if cgroups is not None:  # the kernels' cgroups, in the group of the server's range
            left_cgroups = cgroups_in(cgroups.memory / range_group(first))
            assert left_cgroups != set()
        lock = state_dir() / f"uids-{first}-{first + RANGE_SIZE - 1}.lock"
        assert json.loads(lock.read_text())["pid"] == server.proc.pid  # the dead server's record is still there

        with running(tmp, "--isolation", isolation, "--uid-base", str(first), *flags) as successor:
            assert successor.uid_base() == first
            assert alive(planted) == []
            assert not root.exists()
            if cgroups is not None:
                assert left_cgroups.isdisjoint(cgroups_in(cgroups.memory / range_group(first)))
            if isolation == "namespaces":  # all that runs as the range's uids is the successor's own kernels
                assert set(pids_with_uid_in(uids)) <= set(descendants(successor.proc.pid))
            assert successor.run("print('fresh')", successor.session())["stdout"] == "fresh\n"
        assert not lock.exists()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        for pid in alive(planted):
            os.kill(pid, signal.SIGKILL)
        for process in reap:
            process.wait()
