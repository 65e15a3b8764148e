"""Kernel isolation with real processes and real Jupyter kernels (sandbox.isolation, sandbox.launch).

Namespace tests need root and util-linux `unshare`; they are skipped elsewhere. Kernel uids are
UID_BASE + 990.. so they never meet the kernels of a sandbox server running on the same machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
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

from sandbox.isolation import (
    UID_BASE,
    Isolation,
    Limits,
    _die_with_parent,
    detect_isolation,
    kernel_argv,
    kernel_env,
    kill_uid_processes,
    make_scratch,
    remove_scratch,
)

SECRET = "STARE_SECRET_TOKEN"
TEST_LIMITS = Limits(memory_mb=2048, processes=48, file_size_mb=8, open_files=200)
NS_UID = UID_BASE + 990
FORK_UID = UID_BASE + 991
TERM_UID = UID_BASE + 992


def namespaces_or_skip() -> Isolation:
    isolation = detect_isolation("auto")
    if isolation.mode != "namespaces":
        from sandbox.isolation import _namespace_problem

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


@pytest.mark.parametrize("field", ["memory_mb", "processes", "file_size_mb", "open_files"])
def test_limits_reject_bad_values(field):
    with pytest.raises(ValueError, match=rf"Limits\.{field} must be an integer >= \d+.*got 0"):
        Limits(**{field: 0})
    with pytest.raises(ValueError, match=rf"Limits\.{field}.*got '64'"):
        Limits(**{field: "64"})


def test_detect_isolation_rejects_unknown_mode():
    with pytest.raises(ValueError, match="isolation must be one of auto, namespaces, process; got 'docker'"):
        detect_isolation("docker")


def test_namespaces_need_root(monkeypatch):
    from sandbox.isolation import _namespace_problem

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    _namespace_problem.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="isolation='namespaces' does not work here: .*needs root"):
            detect_isolation("namespaces")
        assert detect_isolation("auto").mode == "process"
    finally:
        _namespace_problem.cache_clear()


def test_kill_uid_processes_refuses_root():
    with pytest.raises(ValueError, match="refusing"):
        kill_uid_processes(0)


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
    }


def test_kernel_argv_has_one_connection_file_placeholder():
    process = kernel_argv(detect_isolation("process"), Limits(), uid=None)
    launch = process.index("sandbox.launch") - 2  # after the parent-death prefix (setpriv or _PDEATHSIG_EXEC)
    assert process[launch : launch + 3] == [sys.executable, "-m", "sandbox.launch"]
    assert process[:launch] == _die_with_parent(sys.executable) != []
    assert process.count("{connection_file}") == 1 and process[-2:] == ["--", "{connection_file}"]
    namespaces = Isolation("namespaces", True, True, True, True, True, True, True)
    argv = kernel_argv(namespaces, Limits(), uid=UID_BASE + 3)
    assert argv.count("{connection_file}") == 1
    assert argv[: launch + 1] == [*_die_with_parent(sys.executable), shutil.which("unshare") or "unshare"]
    assert {"--net", "--pid", "--fork", "--mount-proc", f"--uid={UID_BASE + 3}", "--readonly-root"} <= set(argv)
    with pytest.raises(ValueError, match="needs a kernel uid > 0"):
        kernel_argv(namespaces, Limits(), uid=None)


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


def test_no_network(ns_kernel, host_listener):
    setup = """import socket
def attempt(address):
    try:
        socket.create_connection(address, timeout=2).close()
        return "connected"
    except OSError as e:
        return type(e).__name__"""
    results = ns_kernel.value(f"[attempt(('1.1.1.1', 53)), attempt(('127.0.0.1', {host_listener}))]", setup)
    assert "connected" not in results, results


def test_file_system_read_only_outside_scratch(ns_kernel):
    setup = """import os
def write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as e:
        return type(e).__name__
def read(path):
    try:
        open(path).read()
        return "read"
    except OSError as e:
        return type(e).__name__"""
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
