"""Kernel isolation with real processes and real Jupyter kernels (stare_sandbox.isolation, stare_sandbox.launch).

Namespace tests need root and util-linux `unshare`; they are skipped elsewhere. Kernel uids are just
below UID_BASE, outside every pool's uid range (stare_sandbox.ownership), so they never meet the kernels of a
sandbox server running on the same machine, nor get killed by one reclaiming its range.

The caps per call (CPU seconds, memory of all a kernel's processes, scratch quota) are tested through a
real KernelPool and SessionStore, with and without cgroups.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.kernelspec import KernelSpecManager
from procs import cmdline  # tests/procs.py

from stare_sandbox.cgroups import usable_cgroups
from stare_sandbox.isolation import (
    UID_BASE,
    Isolation,
    Limits,
    _die_with_parent,
    detect_isolation,
    empty_scratch,
    kernel_argv,
    kernel_env,
    make_scratch,
    remove_scratch,
    scratch_bytes,
    scratch_prefix,
)
from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.processes import kill_uid_processes
from stare_sandbox.sessions import SessionStore, run_stateless

SECRET = "STARE_SECRET_TOKEN"
TEST_LIMITS = Limits(memory_mb=2048, processes=48, file_size_mb=8, open_files=200)
NS_UID = UID_BASE - 10
FORK_UID = UID_BASE - 11
TERM_UID = UID_BASE - 12


def namespaces_or_skip() -> Isolation:
    isolation = detect_isolation("auto")
    if isolation.mode != "namespaces":
        from stare_sandbox.isolation import _namespace_problem

        pytest.skip(f"namespace isolation is not available here: {_namespace_problem()}")
    return isolation


def pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`, seen from the host."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            status = Path(entry.path, "status").read_text() if entry.name.isdigit() else ""
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields and int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


@dataclass
class Kernel:
    km: KernelManager
    kc: BlockingKernelClient
    scratch: Path
    uid: int | None

    def run(self, code: str, timeout: float = 30) -> tuple[str, dict]:
        """stdout and the execute_reply content of `code`."""
        out: list[str] = []

        def hook(msg: dict) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, stop_on_error=False)
        return "".join(out), reply["content"]

    def value(self, expression: str, setup: str = "") -> object:
        """The JSON value of `expression` evaluated in the kernel."""
        stdout, reply = self.run(f"{setup}\nimport json as _json\nprint(_json.dumps({expression}))")
        assert reply["status"] == "ok", reply
        return json.loads(stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def started_kernel(
    tmp: Path, isolation: Isolation, uid: int | None, *, scrub_env: bool = True, limits: Limits = TEST_LIMITS
) -> Iterator[Kernel]:
    """A real kernel started the way the sandbox server starts one; everything is cleaned up after.

    The fences are under test here, not how reliably a kernel starts (the pool's own tests cover that):
    a start that does not answer in 30 s is reported as a warning, with what was alive, and tried once
    more. Processes an earlier, killed run left under the test uid are cleared first: they would count
    against the kernel's RLIMIT_NPROC.
    """
    if uid is not None:
        kill_uid_processes(uid)
    for attempt in (1, 2):
        try:
            with _started_kernel(tmp / f"try{attempt}", isolation, uid, scrub_env, limits) as kernel:
                yield kernel
                return
        except _NoAnswer as e:
            if attempt == 2:
                raise RuntimeError(f"the kernel did not answer twice; {e}") from None
            warnings.warn(f"kernel start retried: {e}", stacklevel=1)


class _NoAnswer(Exception):
    pass


@contextlib.contextmanager
def _started_kernel(
    tmp: Path, isolation: Isolation, uid: int | None, scrub_env: bool, limits: Limits
) -> Iterator[Kernel]:
    scratch = make_scratch(tmp / "scratch", uid)
    spec = tmp / "kernels" / "sandbox"
    spec.mkdir(parents=True)
    argv = kernel_argv(isolation, limits, uid)
    kernel_json = {"argv": argv, "display_name": "sandbox", "language": "python", "interrupt_mode": "signal"}
    (spec / "kernel.json").write_text(json.dumps(kernel_json))
    km = KernelManager(kernel_name="sandbox", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))
    km.transport = "ipc"
    km.ip = str(scratch / "ipc")
    km.connection_file = str(scratch / "kernel.json")
    kc = None
    os.environ[SECRET] = "do-not-leak"  # the server's environment holds a secret the kernel must not see
    try:
        km.start_kernel(env=kernel_env(scratch) if scrub_env else dict(os.environ))
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=30)
        except RuntimeError as e:
            alive = km.is_alive()
            uid_pids = {pid: cmdline(pid) for pid in pids_of_uid(uid)} if uid is not None else {}
            raise _NoAnswer(f"{e}; launcher alive: {alive}; processes of uid {uid}: {uid_pids}") from e
        yield Kernel(km, kc, scratch, uid)
    finally:
        os.environ.pop(SECRET, None)
        if kc is not None:
            kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        if uid is not None:
            kill_uid_processes(uid)
        remove_scratch(scratch)


@pytest.fixture(scope="module")
def ns_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    isolation = namespaces_or_skip()
    with started_kernel(tmp_path_factory.mktemp("ns"), isolation, NS_UID) as kernel:
        yield kernel


@pytest.fixture(scope="module")
def process_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    # the server's whole environment is handed over: the launcher itself must scrub it
    with started_kernel(tmp_path_factory.mktemp("proc"), detect_isolation("process"), None, scrub_env=False) as k:
        yield k


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP port listening on the host's loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


# --- values and validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["memory_mb", "processes", "file_size_mb", "open_files", "kernel_memory_mb"])
def test_limits_reject_bad_values(field):
    with pytest.raises(ValueError, match=rf"Limits\.{field} must be an integer >= \d+.*got 0"):
        Limits(**{field: 0})
    with pytest.raises(ValueError, match=rf"Limits\.{field}.*got '64'"):
        Limits(**{field: "64"})


def test_limits_of_the_caps_allow_zero_for_off_and_reject_negatives():
    assert Limits(call_cpu_s=0, scratch_mb=0).call_cpu_s == 0
    with pytest.raises(ValueError, match=r"Limits\.scratch_mb must be an integer >= 0; got -1"):
        Limits(scratch_mb=-1)
    with pytest.raises(ValueError, match=r"Limits\.call_cpu_s must be a number >= 0 \(0 = no cap\); got -1"):
        Limits(call_cpu_s=-1)


def test_detect_isolation_rejects_unknown_mode():
    with pytest.raises(ValueError, match="isolation must be one of auto, namespaces, process; got 'docker'"):
        detect_isolation("docker")


def test_a_server_that_is_not_root_gets_namespaces_through_a_user_namespace(monkeypatch):
    """Not root: no kernel uids to switch to, so each kernel gets a user namespace of its own, in which the launcher
    makes the same mounts and then drops every capability (tests/sandbox/test_non_root.py runs it as another uid)."""
    from stare_sandbox.isolation import Limits, _namespace_problem, kernel_argv

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    _namespace_problem.cache_clear()
    try:
        found = detect_isolation("auto")
        assert found.mode == "namespaces" and found.user_namespace and not found.unprivileged_user
        argv = kernel_argv(found, Limits(), uid=61005)
        assert "--user" in argv and "--map-root-user" in argv and "--drop-capabilities" in argv
        assert not any(a.startswith("--uid") for a in argv)  # the only uid mapped is the server's
    finally:
        _namespace_problem.cache_clear()


def test_kill_uid_processes_refuses_root():
    with pytest.raises(ValueError, match="refusing"):
        kill_uid_processes(0)
    with pytest.raises(ValueError, match="refusing"):
        kill_uid_processes(range(0, 1000))


def test_process_isolation_reports_only_what_it_enforces():
    report = detect_isolation("process").as_dict()
    assert report == {
        "mode": "process",
        "network": False,
        "pid_namespace": False,
        "readonly_root": False,
        "unprivileged_user": False,
        "rlimits": True,
        "scrubbed_env": True,
        "scratch_dir": True,
        "cgroup": usable_cgroups().version if usable_cgroups() is not None else "",
        "uid_base": 0,  # a pool sets its range's
        "user_namespace": False,
    }


def test_kernel_argv_has_one_connection_file_placeholder():
    process = kernel_argv(detect_isolation("process"), Limits(), uid=None)
    launch = process.index("stare_sandbox.launch") - 2  # after the parent-death prefix (_PDEATHSIG_EXEC)
    assert process[launch : launch + 3] == [sys.executable, "-m", "stare_sandbox.launch"]
    assert process[:launch] == _die_with_parent(sys.executable) != []
    assert process.count("{connection_file}") == 1 and process[-2:] == ["--", "{connection_file}"]
    namespaces = Isolation("namespaces", True, True, True, True, True, True, True)
    argv = kernel_argv(namespaces, Limits(), uid=UID_BASE + 3)
    assert argv.count("{connection_file}") == 1
    assert argv[: launch + 1] == [*_die_with_parent(sys.executable), shutil.which("unshare") or "unshare"]
    assert {"--net", "--pid", "--fork", "--mount-proc", f"--uid={UID_BASE + 3}", "--readonly-root"} <= set(argv)
    with pytest.raises(ValueError, match="needs a kernel uid > 0"):
        kernel_argv(namespaces, Limits(), uid=None)
    # a kernel gets its own cgroup, with the memory cap of all its processes, where cgroups work and it has a
    # pool, which holds a uid range (the group of its kernels' cgroups)
    assert not any(a.startswith("--cgroup") for a in argv)
    limits = Limits(kernel_memory_mb=300)
    unpooled = dataclasses.replace(namespaces, cgroup="v1")
    assert not any(a.startswith("--cgroup") for a in kernel_argv(unpooled, limits, 1))
    pooled = dataclasses.replace(namespaces, cgroup="v1", uid_base=62000)
    assert {"--cgroup-group=uids-62000", "--cgroup-memory-mb=300"} <= set(kernel_argv(pooled, limits, 62001))


def test_kernel_env_takes_nothing_from_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET, "x")
    env = kernel_env(tmp_path)
    assert SECRET not in env
    assert env["HOME"] == env["TMPDIR"] == str(tmp_path) and env["LC_ALL"] == "C.UTF-8"
    assert set(env) == {
        "PATH",
        "HOME",
        "TMPDIR",
        "IPYTHONDIR",
        "LANG",
        "LC_ALL",
        "PYTHONDONTWRITEBYTECODE",
        "MPLBACKEND",
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }


def test_scratch_is_private_and_removed_completely(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    outside.chmod(0o500)
    scratch = make_scratch(tmp_path / "root", uid=None)
    assert stat.S_IMODE(scratch.stat().st_mode) == 0o700
    locked = scratch / "a" / "b"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    locked.chmod(0o000)
    (scratch / "a").chmod(0o500)
    (scratch / "link").symlink_to(outside)  # a link the kernel planted must not be followed
    remove_scratch(scratch)
    assert not scratch.exists()
    assert stat.S_IMODE(outside.stat().st_mode) == 0o500 and (outside / "keep").read_text() == "keep"
    remove_scratch(scratch)  # a missing dir is fine
    assert scratch.name.startswith(scratch_prefix(os.getpid()))  # what a successor of a dead owner looks for


def test_scratch_bytes_counts_each_file_once_and_follows_no_link(tmp_path):
    scratch = make_scratch(tmp_path / "root", uid=None)
    (scratch / "sub").mkdir()
    (scratch / "sub" / "a").write_bytes(b"x" * 300_000)
    os.link(scratch / "sub" / "a", scratch / "b")  # the same blocks under two names
    big = tmp_path / "outside"
    big.write_bytes(b"y" * 2_000_000)
    (scratch / "link").symlink_to(big)
    du = subprocess.run(["du", "-s", "-B1", str(scratch)], capture_output=True, text=True, check=True)
    assert scratch_bytes(scratch) == int(du.stdout.split()[0]) < 2_000_000


def test_emptying_a_scratch_dir_keeps_the_kernels_files_and_returns_what_it_removed(tmp_path):
    scratch = make_scratch(tmp_path / "root", uid=None)
    (scratch / "kernel.json").write_text("{}")
    (scratch / ".ipython").mkdir()
    (scratch / "top").write_bytes(b"x" * 100_000)
    locked = scratch / "a" / "b"
    locked.mkdir(parents=True)
    (locked / "f").write_bytes(b"y" * 300_000)
    os.link(locked / "f", scratch / "same")  # counted once
    du = subprocess.run(["du", "-s", "-B1", str(scratch)], capture_output=True, text=True, check=True)
    locked.chmod(0o000)  # unreadable until emptying makes it removable
    (scratch / "a").chmod(0o500)
    kept = (
        scratch_bytes(scratch / ".ipython")
        + scratch_bytes(scratch / "kernel.json")
        + os.lstat(scratch).st_blocks * 512
    )
    removed = empty_scratch(scratch)
    assert sorted(p.name for p in scratch.iterdir()) == [".ipython", "kernel.json"]
    assert removed == int(du.stdout.split()[0]) - kept > 400_000


# --- process mode ------------------------------------------------------------------------------------


def test_process_kernel_has_rlimits_scrubbed_env_and_scratch_cwd(process_kernel):
    k = process_kernel
    assert k.value("[os.getcwd(), os.environ['HOME'], os.environ['TMPDIR']]", "import os") == [str(k.scratch)] * 3
    assert k.value(f"{SECRET!r} in os.environ", "import os") is False
    limits = k.value("[resource.getrlimit(getattr(resource, n)) for n in names]", RLIMIT_SETUP)
    assert limits == expected_rlimits(TEST_LIMITS)


RLIMIT_SETUP = "import resource\nnames = ['RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_CORE']"


def expected_rlimits(limits: Limits) -> list[list[int]]:
    values = [limits.memory_mb * 2**20, limits.processes, limits.file_size_mb * 2**20, limits.open_files, 0]
    return [[v, v] for v in values]


# --- namespace mode ----------------------------------------------------------------------------------

ATTEMPT = """import socket
def attempt(address):
    try:
        socket.create_connection(address, timeout=2).close()
        return "connected"
    except OSError as e:
        return type(e).__name__"""
"""Defines attempt(address): "connected", or the name of the error a connection got (test_container.py too)."""
WRITE = """import os
def write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as e:
        return type(e).__name__"""
"""Defines write(path): "written", or the name of the error writing the file got (test_container.py too)."""


def test_no_network(ns_kernel, host_listener):
    results = ns_kernel.value(f"[attempt(('1.1.1.1', 53)), attempt(('127.0.0.1', {host_listener}))]", ATTEMPT)
    assert "connected" not in results, results


def test_file_system_read_only_outside_scratch(ns_kernel):
    setup = (
        WRITE
        + """
def read(path):
    try:
        open(path).read()
        return "read"
    except OSError as e:
        return type(e).__name__"""
    )
    marker = f"sandbox-test-{os.getpid()}"
    targets = [f"/tmp/{marker}", f"/root/{marker}", f"/work/{marker}", f"{ns_kernel.scratch.parent}/{marker}"]
    results = ns_kernel.value(f"[write(p) for p in {targets!r}]", setup)
    assert "written" not in results, dict(zip(targets, results, strict=True))
    assert not any(os.path.exists(p) for p in targets)
    assert ns_kernel.value("[read('/etc/shadow'), write('in-scratch.txt'), os.getcwd()]", setup) == [
        "PermissionError",
        "written",
        str(ns_kernel.scratch),
    ]
    assert (ns_kernel.scratch / "in-scratch.txt").read_text() == "x"
    # /dev/shm is writable (multiprocessing needs it) but private to the kernel
    assert ns_kernel.value(f"write('/dev/shm/{marker}')", setup) == "written"
    assert not os.path.exists(f"/dev/shm/{marker}")


def test_runs_as_its_own_uid(ns_kernel):
    assert ns_kernel.value("[os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]", "import os") == [
        NS_UID,
        NS_UID,
        NS_UID,
        [],
    ]
    assert (ns_kernel.scratch / "kernel.json").stat().st_uid == NS_UID


def test_cannot_see_or_signal_the_server(ns_kernel):
    setup = f"""import os
try:
    os.kill({os.getpid()}, 0)
    signalled = "signalled"
except OSError as e:
    signalled = type(e).__name__"""
    expression = (
        f"[signalled, os.path.exists('/proc/{os.getpid()}'), "
        "sorted(int(p) for p in os.listdir('/proc') if p.isdigit())]"
    )
    signalled, visible, pids = ns_kernel.value(expression, setup)
    assert signalled == "ProcessLookupError" and not visible
    assert pids[:2] == [1, 2]  # the launcher as init, the kernel; only their own processes are visible


def test_namespace_kernel_rlimits(ns_kernel):
    assert ns_kernel.value("[resource.getrlimit(getattr(resource, n)) for n in names]", RLIMIT_SETUP) == (
        expected_rlimits(TEST_LIMITS)
    )


def test_environment_is_scrubbed(ns_kernel):
    environ = ns_kernel.value("dict(os.environ)", "import os")
    assert SECRET not in environ
    expected = kernel_env(ns_kernel.scratch)
    assert {k: environ[k] for k in expected} == expected
    # IPython adds a few of its own (TERM, PAGER, ...); none may carry a value from the server's environment
    from_server = {k for k in set(environ) - set(expected) if os.environ.get(k) == environ[k]}
    assert not from_server


def test_numpy_and_sympy_import(ns_kernel):
    assert ns_kernel.value("[int(numpy.arange(4).sum()), str(sympy.factor('x**2 - 1'))]", "import numpy, sympy") == [
        6,
        "(x - 1)*(x + 1)",
    ]


def test_interrupt_stops_a_busy_loop_and_the_kernel_survives(ns_kernel):
    # stop_on_error=False (as in Kernel.run): otherwise ipykernel 7 may abort the next request too (it
    # stops aborting only when a dummy message it posts to itself comes through, maybe after that request)
    msg_id = ns_kernel.kc.execute("print('looping', flush=True)\nwhile True: pass", stop_on_error=False)
    # interrupt only once the loop runs: a SIGINT that lands between two cells is ignored by ipykernel
    while True:
        msg = ns_kernel.kc.get_iopub_msg(timeout=10)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            break
    time.sleep(0.2)
    ns_kernel.km.interrupt_kernel()
    reply = ns_kernel.kc.get_shell_msg(timeout=10)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert ns_kernel.value("1 + 1") == 2


def test_memory_bomb_raises_memory_error(ns_kernel):
    _, reply = ns_kernel.run("x = bytearray(8 * 2**30)")
    assert reply["status"] == "error" and reply["ename"] == "MemoryError"
    assert ns_kernel.value("'alive'") == "alive"


def test_fork_bomb_is_bounded_and_everything_dies_with_the_kernel(tmp_path):
    isolation = namespaces_or_skip()
    with started_kernel(tmp_path, isolation, FORK_UID) as k:
        setup = """import os, time
forks, error = 0, None
try:
    while forks < 500:
        if os.fork() == 0:
            os.setsid()  # leave the kernel's process group: only the PID namespace can catch these
            time.sleep(600)
            os._exit(0)
        forks += 1
except OSError as e:
    error = type(e).__name__"""
        forks, error = k.value("[forks, error]", setup)
        assert error == "BlockingIOError" and 0 < forks < TEST_LIMITS.processes, (forks, error)
        assert len(pids_of_uid(FORK_UID)) > forks  # the children are alive, next to the kernel
        # kill only the `unshare` process: its child, the namespace's PID 1, and so all the rest must follow
        os.kill(k.km.provisioner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pids_of_uid(FORK_UID) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_of_uid(FORK_UID) == []
        scratch = k.scratch
    assert not scratch.exists()


def test_orphans_are_reaped_and_sigterm_ends_the_kernel(tmp_path):
    isolation = namespaces_or_skip()
    with started_kernel(tmp_path, isolation, TERM_UID) as k:
        # a grandchild orphaned to PID 1 must not stay a zombie (PID 1 is the launcher, an init that reaps)
        setup = """import os, time
child = os.fork()
if child == 0:
    if os.fork() == 0:
        time.sleep(0.3)
        os._exit(0)
    os._exit(0)
os.waitpid(child, 0)
time.sleep(1.0)
states = [open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] for p in os.listdir("/proc") if p.isdigit()]"""
        assert "Z" not in k.value("states", setup)
        # jupyter_client's second shutdown step, SIGTERM to the process group, must end the kernel: a
        # kernel that were PID 1 itself would ignore it
        k.km.signal_kernel(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pids_of_uid(TERM_UID) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_of_uid(TERM_UID) == []


# --- caps per call (a real pool) ---------------------------------------------------------------------

CAP_CASES = [
    pytest.param("process", True, id="process-cgroup"),
    pytest.param("process", False, id="process-rlimits"),
    pytest.param("namespaces", True, id="namespaces-cgroup"),
]


def caps_case_or_skip(isolation: str, cgroups: bool) -> None:
    if isolation == "namespaces":
        namespaces_or_skip()
    if cgroups and usable_cgroups() is None:
        from stare_sandbox.cgroups import cgroup_problem

        pytest.skip(f"cgroups are not usable here: {cgroup_problem()}")


def pool_settings(isolation: str, cgroups: bool, limits: Limits) -> PoolSettings:
    return PoolSettings(pool_size=1, max_kernels=4, isolation=isolation, cgroups=cgroups, limits=limits)


def with_pool(settings: PoolSettings, work):
    """Run `await work(pool, sessions)` against a started pool, closed after; returns what it returns."""

    async def go():
        pool = KernelPool(settings)
        await pool.start()
        try:
            return await work(pool, SessionStore(pool, max_sessions=4, idle_s=600))
        finally:
            await pool.close()

    return asyncio.run(go())


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


# Two children spin while the kernel itself only waits: the CPU they use must count for the call.
SPINNING_CHILDREN = """
import os
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while True:
            pass
    children.append(pid)
print(*children, flush=True)
for pid in children:
    os.waitpid(pid, 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("isolation", "cgroups"), CAP_CASES)
def test_cpu_cap_stops_a_call_whose_processes_spin_and_the_session_goes_on(isolation, cgroups):
    caps_case_or_skip(isolation, cgroups)
    settings = PoolSettings(
        pool_size=1, max_kernels=4, isolation=isolation, cgroups=cgroups, limits=Limits(call_cpu_s=2)
    )

    async def work(pool, sessions):
        sid = await sessions.create()
        assert (await sessions.execute(sid, "x = 1", 10)).status == "ok"
        spun = await sessions.execute(sid, SPINNING_CHILDREN, 100)  # the wall-clock limit is far away
        after = await sessions.execute(sid, "print(1 + 1)\nprint(x)", 10)
        return spun, after, pool.caps()

    spun, after, caps = with_pool(settings, work)
    assert (spun.status, spun.error.name) == ("timeout", "CPULimit"), spun
    assert "more than 2 CPU seconds" in spun.error.message and "limits.call_cpu_s" in spun.error.message
    if isolation == "process":  # host pids: the spinning children were killed with the kernel
        assert all(gone(int(pid)) for pid in spun.stdout.split())
    # the session goes on, on a fresh kernel
    assert after.stdout == "2\n" and after.error.name == "NameError"
    measured_by = f"cgroup {usable_cgroups().version}" if cgroups else "session"
    assert caps["call_cpu_s"] == {"by": measured_by, "seconds": 2}


# Four children each hold 150 MiB (written, so resident), together twice the kernel's cap of 300 MiB.
MEMORY_HOGS = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        try:
            block = b"x" * ({mib} * 2**20)
        except MemoryError:
            os._exit(3)
        time.sleep(100)
        os._exit(0)
    children.append(pid)
print(*[os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])
"""


@pytest.mark.slow
@pytest.mark.parametrize(("isolation", "cgroups"), CAP_CASES)
def test_memory_of_all_processes_is_capped_without_harming_the_server(isolation, cgroups):
    """With a cgroup the processes together are capped and the call stopped; with rlimits only (the fallback),
    each process gets a MemoryError at its own address-space limit."""
    caps_case_or_skip(isolation, cgroups)
    settings = pool_settings(isolation, cgroups, Limits(memory_mb=1024, kernel_memory_mb=300))
    mib = 150 if cgroups else 1100  # without a cgroup: more than one process's address space

    async def work(pool, sessions):
        sid = await sessions.create()
        hog = await sessions.execute(sid, MEMORY_HOGS.format(mib=mib), 60)
        after = await sessions.execute(sid, "print('alive')", 10)
        stateless = await run_stateless(pool, "print(2 + 2)", 10)
        return hog, after, stateless, pool.caps()

    hog, after, stateless, caps = with_pool(settings, work)
    if cgroups:
        assert (hog.status, hog.error.name) == ("memory", "MemoryLimit"), hog
        assert "300 MiB" in hog.error.message and "limits.kernel_memory_mb" in hog.error.message
        assert caps["memory"]["kernel_mb"] == 300 and caps["memory"]["by"].startswith("cgroup")
    else:
        assert (hog.status, hog.stdout) == ("ok", "3 3 3 3\n"), hog  # each child: MemoryError
        assert caps["memory"] == {
            "by": "rlimit per process",
            "kernel_mb": None,
            "process_mb": 1024,
            "no_cgroup_because": "pool.cgroups is off",
        }
    assert after.stdout == "alive\n" and stateless.stdout == "4\n"


# Writes 1 MiB files at a pace, printing how many it wrote: a call not stopped would get to 200.
SLOW_WRITER = """
import os, time
print(os.getcwd(), flush=True)
for i in range(200):
    with open(f"f{i}", "wb") as f:
        f.write(b"x" * 2**20)
    print(i, flush=True)
    time.sleep(0.05)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("isolation", "cgroups"), CAP_CASES)
def test_scratch_quota_stops_a_writer_and_frees_its_files(isolation, cgroups):
    caps_case_or_skip(isolation, cgroups)
    settings = PoolSettings(
        pool_size=1, max_kernels=4, isolation=isolation, cgroups=cgroups, limits=Limits(scratch_mb=8)
    )

    async def work(pool, sessions):
        sid = await sessions.create()
        writer = await sessions.execute(sid, SLOW_WRITER, 100)
        scratch = Path(writer.stdout.split()[0])
        freed = not scratch.exists()  # the session's old kernel is replaced before the call returns
        after = await sessions.execute(sid, "import os\nprint(sorted(os.listdir('.')))", 10)
        # a stateless call that writes past the quota too fast to be caught while it runs: caught after it
        burst = await run_stateless(pool, "for i in range(12):\n    open(f'g{i}', 'wb').write(b'y' * 2**20)", 30)
        return writer, freed, after, burst

    writer, freed, after, burst = with_pool(settings, work)
    assert (writer.status, writer.error.name) == ("error", "ScratchQuota"), writer
    assert "over the quota of 8 MiB" in writer.error.message and "limits.scratch_mb" in writer.error.message
    assert int(writer.stdout.split()[-1]) < 199  # stopped while it wrote
    assert freed
    assert after.status == "ok" and "'f0'" not in after.stdout
    assert (burst.status, burst.error.name) == ("error", "ScratchQuota"), burst
