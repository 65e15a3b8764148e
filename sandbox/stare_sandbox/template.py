"""A kernel whose user code runs in processes forked from a clean, thread-free template (`pool.clean_state: fork`).

`python -m stare_sandbox.template WARMUP_B64 -- IPYKERNEL_ARGS` is what the launcher (launch.py) starts in place of
`ipykernel_launcher`, inside the kernel's fences. Before any thread exists it runs the pool's warm-up code (numpy
and sympy imported) and forks:

- the **template** (the child) never runs user code. It waits on a socket for requests from the kernel and
  answers each with a **worker** it forked ahead (once the worker before it ended): a copy-on-write copy of its
  clean state, whose modules, `sys` settings, builtins, environment, working directory, open files, signal handlers
  and atexit list are those the template had after the warm-up, whatever earlier workers did, and which has copied,
  while it waited, the pages that running any cell writes (Template.warm, learned once). It has one thread
  when it forks (checked before every fork: a fork copies only the forking thread, so a lock another thread held
  would stay locked in the worker forever). When the kernel is done with a worker, the template stops it, kills
  what it left running, empties the scratch dir and only then reports to the kernel (and kills the worker); a
  worker that ended on its own is cleaned up after when it is reaped;
- the **kernel** (the parent) then runs ipykernel as before (`relay_kernel_class`). A request whose metadata names
  a worker mode is relayed: `call` runs the code in a new worker, ended after it (a stateless run), `session`
  in the kernel's one session worker, started by its first call and kept until `end` (variables persist within
  it). Either way the reply waits for the template's report, so the pool gets the kernel back clean, or told
  (WORKER_END_MIME) that it is not. Other requests (the pool's own warm-up) run in the kernel itself.

A worker inherits every fence of its kernel (namespaces, uid, rlimits, cgroup): it is a process of the same kernel,
in the same process group, so the pool's interrupt, caps and kill reach it as they reach the kernel. Its fd 1 and 2
are pipes the kernel reads and republishes as stream output (also what its child processes print), its fd 0 is
/dev/null, and it talks to the kernel over a socket: the cell's code in, then a "done" message with the cell's
error, if any, and the display messages that must reach the client (fetched files). It runs the cell with IPython's
`run_cell` (magics, the last expression's value printed), as the kernel would. The template and every worker get
the parent-death signal: a kernel that dies takes its template and workers with it.

The other way round, no call may pass for done without the worker that ran it: a worker reports `started` before
any of a cell's code and `done` after it, both carrying the call's id (the execute request's msg_id), and the kernel
confirms a call to the pool (WORKER_DONE_MIME) only on that `done`. A template found gone (the kernel also watches it
through a pipe only the template writes to, _TemplateWatch), a refusal, or a report out of turn is a RELAY_ERROR,
which says whether the code had started; the pool then retires the kernel. A template that dies while no call runs
ends the kernel (TEMPLATE_GONE_EXIT), so the pool replaces it before handing it out. What happens when each of these
processes dies: docs/sandbox.md, "When a kernel's process dies".
"""

from __future__ import annotations

import base64
import codecs
import ctypes
import errno
import gc
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from stare_sandbox.isolation import empty_scratch
from stare_sandbox.processes import kill_until_gone, parent_of, process_table

WORKER_KEY = "stare_worker"
"""The execute request's metadata key that asks for a worker: its value is one of WORKER_MODES."""
WORKER_MODES = ("call", "session", "end")
WORKER_END_MIME = "application/x-stare-worker-end"
"""The MIME type of the display by which the kernel tells the pool what the template found when a worker ended, if
anything: {"scratch_bytes": what the worker left in the scratch dir (for the scratch quota, checked after the call),
"unclean": why the scratch dir could not be emptied, or None (the pool then retires the kernel), "gone": why the
template is gone, or None (the call's result stands, but the pool retires the kernel)}."""
WORKER_DONE_MIME = "application/x-stare-worker-done"
"""The MIME type of the display by which the kernel confirms a worker call: {"call": the execute request's msg_id}.
The kernel publishes it only after the worker's own report of that call (which carries the same id), or for `end`
once the session's worker is ended; a worker call answered without it is a sandbox_error, never an `ok` with lost
output (kernel.py)."""
EXIT_ERROR = "_SandboxWorkerExited"
"""The error the kernel reports when the worker running a cell ended without finishing it. Its message is JSON:
{"status": the worker's exit status as subprocess gives it (-N for signal N), "ran": whether the worker had begun
the cell (False: it died before, e.g. a spare killed as it was handed out)}."""
RELAY_ERROR = "_SandboxRelayFailed"
"""The error the kernel reports when it cannot run the call as designed: its template is gone (killed, or dead
with what it needed), refused to fork, or a worker broke the protocol. Its message is JSON: {"ran": whether the code
may have started (False: no worker began it), "why": what happened}. The pool retires the kernel."""
TEMPLATE_GONE_EXIT = 75
"""The kernel's exit status when its template died while no call was running: the pool then finds the kernel gone
and replaces it before any call lands on it (KernelPool._take_ready)."""
_FRAME = 8  # bytes of the length before each message on a worker socket
_END_WAIT_S = 10.0  # for the template to report a worker's end (its leftovers killed, the scratch dir emptied)
_GONE_GRACE_S = 1.0  # after a call, before an idle kernel whose template died exits: its reply is on its way out
_EARLY_CODE_CHARS = 32_768  # a cell up to this size is sent before its worker is known (it fits the socket buffer)
_PR_SET_PDEATHSIG = 1
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable (a copy-on-write page is copied), contents kept
_PAGE_OWN = 1 << 63 | 1 << 56  # a pagemap entry's bits: present, mapped by this process only
_REGION_MAX_BYTES = 1 << 30  # larger mappings are not searched for warm pages (8 bytes of pagemap per 4 KiB page)
WARM_CELL = "print(0)\n"
"""The cell whose pages each worker copies ahead (Template.warm): what running any cell writes."""


def encode_warmup(code: str) -> str:
    """The warm-up code as one argv word (never empty, never starting with a dash)."""
    return "w" + base64.urlsafe_b64encode(code.encode()).decode("ascii")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: python -m stare_sandbox.template WARMUP_B64 -- IPYKERNEL_ARGS")
    warmup = base64.urlsafe_b64decode(argv[0][1:]).decode()
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(warmup, "<warm-up>", "exec"), namespace)  # noqa: S102 - the pool's own code
    except Exception:  # noqa: S110 - the pool's own run of it in the kernel fails the same way, and says why
        pass
    import IPython.core.interactiveshell  # noqa: F401 - imported once here, shared by every worker

    # Collected and frozen before the fork: neither process's collections then write to (and copy) the pages the
    # two share, and the template's freeze, after its own warm-up, costs it no pass over them either.
    gc.collect()
    gc.freeze()
    kernel_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Only the template holds the write end (its workers close their copies first thing): the kernel's read end
    # reaches end-of-file the moment the template is gone, however it died (_TemplateWatch).
    alive_r, alive_w = os.pipe()
    kernel_pid = os.getpid()
    if os.fork() == 0:
        kernel_end.close()
        os.close(alive_r)
        _die_with_parent(kernel_pid)
        Template(template_end, namespace, alive_w).serve()
        os._exit(0)
    template_end.close()
    os.close(alive_w)
    from ipykernel.kernelapp import IPKernelApp

    link = _TemplateLink(kernel_end, _TemplateWatch(alive_r))
    IPKernelApp.launch_instance(argv=argv[2:], kernel_class=relay_kernel_class(link))


def _ending(status: int | None = None, scratch_bytes: int = 0, unclean: str | None = None) -> dict:
    """How a worker ended, as the template reports it: its exit status (None: the template stopped it, or nobody
    knows), the disk space it left in the scratch dir, and why that dir could not be emptied (None: it was)."""
    return {"status": status, "scratch_bytes": scratch_bytes, "unclean": unclean}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the parent (its forking thread) ends; exit now if it is gone already."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def thread_count() -> int:
    """Threads of this process, those Python did not start too (from /proc where it exists)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


PRIMERS = {
    "sympy": """\
x, y = sympy.symbols("x y")
sympy.factor(x**2 - 1); sympy.expand((x + y)**3); sympy.simplify(sympy.sin(x)**2 + sympy.cos(x)**2)
sympy.solve(x**2 - 2, x); sympy.integrate(x * sympy.exp(x), x); sympy.limit(sympy.sin(x) / x, x, 0)
sympy.Rational(1, 3) + sympy.sqrt(8); sympy.isprime(97); sympy.nsimplify(0.5)
str(sympy.Matrix([[1, 2], [3, 4]]).det())
""",
    "numpy": "numpy.linalg.solve(numpy.eye(2), numpy.ones(2)); numpy.arange(10).sum()\n",
}
"""Run once in the template, each in a namespace of its own and only for a library the warm-up imported (a primer
must not load one: that would cost every kernel its memory): the first call of a sympy routine in a process builds
what it caches (tens of milliseconds), and without this every worker would pay that again. Every worker starts from
the same primed state, so this changes no result, only how soon the first calls return."""


def _prime() -> None:
    for module, code in PRIMERS.items():
        if module in sys.modules:
            try:
                exec(code, {"__name__": "__primer__", module: sys.modules[module]})  # noqa: S102 - our own code
            except Exception:  # noqa: S110 - the workers just start colder
                pass


def writable_regions(maps: str) -> list[tuple[int, int]]:
    """(start, end) of the private writable mappings in a /proc/PID/maps text: where copy-on-write copies pages.
    Those over _REGION_MAX_BYTES are left out (an allocator's reserve: reading its page entries would cost more
    memory than the pages it ever touches)."""
    regions = []
    for line in maps.splitlines():
        span, perms = line.split(maxsplit=2)[:2]
        start, end = (int(value, 16) for value in span.split("-"))
        if perms.startswith("rw") and perms[3] == "p" and end - start <= _REGION_MAX_BYTES:
            regions.append((start, end))
    return regions


def own_pages(pagemap: str, regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, length) runs of the pages within `regions` that the process of `pagemap` (a /proc/PID/pagemap path)
    maps alone: after a fork, the pages it wrote (and so copied) or were new. Every region is read before any is
    parsed, so that the parsing's own writes are not counted."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open(pagemap, "rb", buffering=0) as source:
        entries = [os.pread(source.fileno(), (end - start) // page * 8, start // page * 8) for start, end in regions]
    runs: list[list[int]] = []
    for (start, _), data in zip(regions, entries, strict=True):
        for index, entry in enumerate(memoryview(data).cast("Q")):
            if entry & _PAGE_OWN == _PAGE_OWN:
                address = start + index * page
                if runs and runs[-1][0] + runs[-1][1] == address:
                    runs[-1][1] += page
                else:
                    runs.append([address, page])
    return [(start, length) for start, length in runs]


def copy_ahead(runs: list[tuple[int, int]], interrupt: socket.socket | None = None) -> None:
    """Fault the pages of `runs` in writable now, contents unchanged: a forked process then takes no copy-on-write
    fault on them later. Stops early once `interrupt` is readable (the work it was waiting for came), and without a
    word where the kernel cannot (before Linux 5.14) or a run is no longer mapped."""
    madvise = _libc().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for index, (start, length) in enumerate(runs):
        if interrupt is not None and index % 32 == 0 and select.select([interrupt], [], [], 0)[0]:
            return
        if madvise(start, length, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
            return


class Template:
    """The clean interpreter workers are forked from; serves the kernel's requests until the kernel goes."""

    def __init__(self, sock: socket.socket, namespace: dict[str, Any], alive: int = -1):
        from IPython.core.interactiveshell import InteractiveShell

        self.sock = sock
        self.alive = alive  # the write end of the kernel's watch on this process (main): workers close it
        self.scratch = os.environ["HOME"]  # the kernel's scratch dir (isolation.kernel_env), every worker's cwd
        self.kernel = os.getppid()
        # the kernel's parent is PID 1 only inside the kernel's own PID namespace (launch.py's init)
        self.own_namespace = parent_of(self.kernel) == 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool interrupts the kernel's whole process group
        # No history database (it would start a thread and write outside the scratch dir).
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.enabled = False
        self.shell = InteractiveShell.instance(config=config, user_ns=namespace)
        # IPython's first cell in a process is ~10x slower than the next (its machinery warms up): pay it here once,
        # not in every worker. Then freeze what exists, so a collection in a worker neither scans nor, by writing
        # to their headers, copies the template's objects page by page.
        for _ in range(2):
            self.shell.run_cell("pass", store_history=False, silent=True)
        _prime()
        gc.freeze()  # no collection first: it would write to, and so copy, every object the kernel shares with it
        self.workers: set[int] = set()  # live workers, the spare included
        self.finished: set[int] = set()  # stopped by _finish and killed, not reaped yet
        self.spare: tuple[int, socket.socket] | None = None  # a worker forked ahead, and where its descriptors go
        self.refusal = ""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        self.warm: list[tuple[int, int]] = []  # the pages every spare copies ahead: none for the worker that finds
        self.warm = self._learn_warm()  # them
        self._fork_spare()

    def _learn_warm(self) -> list[tuple[int, int]]:
        """The pages a worker writes to run a cell whatever its code (WARM_CELL, run by a worker like any other with
        its output to /dev/null): about 1,200 copy-on-write faults, 2-3 us each, that each spare now takes while it
        waits instead of its call (copy_ahead). None where they cannot be found (no /proc: the worker fails)."""
        self._fork_spare()
        if self.spare is None:
            return []
        pid, handoff = self.spare
        self.spare = None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            socket.send_fds(handoff, [json.dumps({"mode": "probe"}).encode()], [null, null, theirs.fileno()])
            _send(mine, {"code": WARM_CELL})
            _receive(mine)  # started
            _receive(mine)  # done
            report = _receive(mine)
            return [(start, length) for start, length in report["warm"]] if report else []
        except OSError:
            return []
        finally:
            for end in (handoff, mine, theirs):
                end.close()
            os.close(null)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.workers.discard(pid)

    def serve(self) -> None:
        while True:
            readable, _, _ = select.select([self.sock, self.wake_r], [], [])
            if self.wake_r in readable:
                while os.read(self.wake_r, 512) == 512:
                    pass
                self._reap()
            if self.sock in readable:
                try:
                    data, fds, _, _ = socket.recv_fds(self.sock, 4096, 3)
                except OSError:
                    return  # the kernel is gone
                if not data:
                    return
                request = json.loads(data)
                if "finish" in request:
                    self._finish(request["finish"])
                else:
                    self._spawn(request, fds)

    def _reap(self) -> None:
        """Reap ended workers; one that ended on its own (or was killed by the kernel) is cleaned up after here."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.finished:  # cleaned up after when it was stopped (_finish), or a spare discarded
                self.finished.discard(pid)
                continue
            self.workers.discard(pid)
            if self.spare is not None and pid == self.spare[0]:
                # The spare never ran a cell: nothing to clean up or report. Something killed it (the worker of the
                # call or session running now may): the next request forks another (_spawn).
                self.spare[1].close()
                self.spare = None
                continue
            self._cleaned_up(pid, os.waitstatus_to_exitcode(status))

    def _finish(self, pid: int) -> None:
        """End a worker the kernel is done with (it ran its call, or its session closed): SIGSTOP it, so that none
        of its threads runs again, clean up after it, and only then kill it: the exit, which tears down its memory
        (milliseconds), happens off the call's path. A worker that already ended was cleaned up after when reaped."""
        if pid not in self.workers or self.spare is not None and pid == self.spare[0]:
            return
        os.kill(pid, signal.SIGSTOP)
        _, status = os.waitpid(pid, os.WUNTRACED)
        self.workers.discard(pid)
        if os.WIFSTOPPED(status):
            self.finished.add(pid)
            self._cleaned_up(pid, None)
            os.kill(pid, signal.SIGKILL)
        else:  # it exited before it stopped
            self._cleaned_up(pid, os.waitstatus_to_exitcode(status))

    def _cleaned_up(self, pid: int, status: int | None) -> None:
        """Kill what the ended (or stopped) worker left running, empty the scratch dir, and tell the kernel."""
        self._sweep()
        self.sock.send(json.dumps({"exited": pid, **_ending(status, *self._empty_scratch())}).encode())
        if self.spare is None:  # now, while the kernel answers the call: not while the call's worker runs
            self._fork_spare()

    def _sweep(self) -> None:
        """SIGKILL what ended workers left running: every process of the kernel's PID namespace, or without one of
        the kernel's session (jupyter_client makes the kernel a session leader), but the init, the kernel, this
        template, the live workers and their own children. Nothing where the kernel is neither (it would hit
        processes that are not the kernel's)."""
        session = os.getsid(0)
        if not self.own_namespace and session != self.kernel:
            return
        keep = {1, os.getpid(), self.kernel, *self.workers, *self.finished}  # finished ones are stopped

        def left() -> list[int]:
            return [
                pid
                for pid, (parent, sid) in process_table().items()
                if pid not in keep and parent not in self.workers and (self.own_namespace or sid == session)
            ]

        kill_until_gone(left)

    def _empty_scratch(self) -> tuple[int, str | None]:
        """Remove what the ended worker left in the scratch dir, after its processes are gone (so none can write
        there again): the disk space it took, and why it could not be removed, or None."""
        try:
            return empty_scratch(self.scratch), None
        except (OSError, RecursionError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    def _spawn(self, request: dict, fds: list[int]) -> None:
        """Hand the kernel's descriptors to the spare worker, forked ahead (when the template had cleaned up after
        the worker before it, while the kernel answered that call), so the fork is off the call's path. A spare
        that died unreaped (its handoff fails) is discarded and a new one forked, once."""
        try:
            for _ in range(2):
                if len(fds) != 3:
                    self.refusal = f"{len(fds)} file descriptors came"
                    break
                if self.spare is None:  # none forked since the last handoff (a session's worker), or it died
                    self._fork_spare(inherited=fds)
                if self.spare is None:  # the fork was refused (self.refusal says why)
                    break
                pid, handoff = self.spare
                self.spare = None
                try:
                    socket.send_fds(handoff, [json.dumps({"mode": request.get("mode")}).encode()], fds)
                except OSError:
                    self._discard(pid)
                    continue
                finally:
                    handoff.close()
                self.sock.send(json.dumps({"spawned": pid}).encode())
                return
            self.sock.send(json.dumps({"refused": self.refusal or "no live worker could be handed out"}).encode())
        finally:
            for fd in fds:
                os.close(fd)

    def _discard(self, pid: int) -> None:
        """Kill a worker that never ran a cell; reaped later, with nothing to clean up or report (_reap)."""
        self.workers.discard(pid)
        self.finished.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _fork_spare(self, inherited: tuple[int, ...] | list[int] = ()) -> None:
        """A worker that waits for its descriptors; none while the template has more than one thread. `inherited`:
        descriptors the template holds for another worker, which the new one closes at once."""
        threads = thread_count()
        if threads != 1:
            self.refusal = f"the template has {threads} threads; a fork would copy only one of them"
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError as exc:  # e.g. the kernel's process limit, while ended workers are still exiting
            mine.close()
            theirs.close()
            self.refusal = f"the template could not fork a worker: {exc}"
            return
        if pid == 0:
            try:
                for fd in inherited:
                    os.close(fd)
                mine.close()
                _Worker(self, theirs).serve()
            finally:
                os._exit(0)
        theirs.close()
        self.workers.add(pid)
        self.spare = (pid, mine)


class _Worker:
    """Runs cells on a copy of the template: one (a stateless call), or until the kernel ends it (a session)."""

    def __init__(self, template: Template, handoff: socket.socket):
        _die_with_parent(os.getppid())
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        template.sock.close()
        for fd in (template.wake_r, template.wake_w, template.alive):
            if fd >= 0:
                os.close(fd)
        if template.spare is not None:  # the previous spare's socket, inherited
            template.spare[1].close()
        copy_ahead(template.warm, interrupt=handoff)
        data, fds, _, _ = socket.recv_fds(handoff, 4096, 3)  # wait to be handed out
        handoff.close()
        if not data or len(fds) != 3:
            os._exit(0)  # the template is gone
        mode = json.loads(data).get("mode")
        # the template's own run of WARM_CELL: its mappings now, before the cell maps any
        self.probe = writable_regions(_read("/proc/self/maps")) if mode == "probe" else None
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out, err, control = fds
        null = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(source, target)
            os.close(source)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "rb", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = _text_stream(1)
        sys.stderr = sys.__stderr__ = _text_stream(2)
        self.conn = socket.socket(fileno=control)
        self.session = mode == "session"
        self.shell = template.shell
        self.error: dict | None = None
        self.displays: list[dict] = []
        self._hook_shell()

    def _hook_shell(self) -> None:
        shell, worker = self.shell, self

        def show_traceback(etype: type, evalue: BaseException, stb: list[str]) -> None:
            worker.error = {"ename": etype.__name__, "evalue": str(evalue), "traceback": stb}

        def publish(data: dict, metadata: dict | None = None, **_: Any) -> None:
            worker.displays.append({"data": data, "metadata": metadata or {}})

        shell._showtraceback = show_traceback
        shell.display_pub.publish = publish
        hook = shell.displayhook

        hook.write_output_prompt = lambda: None
        hook.write_format_data = lambda format_dict, md_dict=None: print(format_dict.get("text/plain", ""))

    def serve(self) -> None:
        while True:
            request = _receive(self.conn)
            if request is None:
                return
            self.error, self.displays = None, []
            _send(self.conn, {"started": request.get("call")})  # before any of its code: the kernel knows it ran
            self.shell.run_cell(request["code"], store_history=False, silent=False)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: S110 - the code closed or replaced it: nothing left to flush
                    pass
            report = {"done": True, "call": request.get("call"), "error": self.error, "displays": self.displays}
            _send(self.conn, report)
            if self.probe is not None:
                _send(self.conn, {"warm": own_pages("/proc/self/pagemap", self.probe)})
                return
            if not self.session:  # the kernel has the template stop it (_finish): exiting now would cost the call
                _receive(self.conn)  # the time its memory takes to tear down
                return


def _read(path: str) -> str:
    with open(path) as source:
        return source.read()


def _text_stream(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(
        io.FileIO(fd, "wb", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )


def _send(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(len(data).to_bytes(_FRAME, "big") + data)


def _receive(conn: socket.socket) -> dict | None:
    """The next message, or None at the end of the stream."""
    head = _exactly(conn, _FRAME)
    if head is None:
        return None
    body = _exactly(conn, int.from_bytes(head, "big"))
    return None if body is None else json.loads(body)


def _exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _RelayFailed(Exception):
    """The kernel could not run a worker call as designed: its template is gone or refused to fork, or a worker broke
    the protocol. `ran`: whether the call's code may have started; None leaves it to the relay (_Relay.started)."""

    def __init__(self, why: str, ran: bool | None = None):
        super().__init__(why)
        self.why, self.ran = why, ran


class _TemplateWatch:
    """The kernel's watch on its template: the read end of a pipe whose write end only the template holds (main), so
    it reaches end-of-file the moment the template is gone, however it died (a worker's kill, the OOM killer).

    A template that dies while a worker call runs is reported by that call (do_execute), and the pool retires the
    kernel. One that dies while the kernel is idle ends the kernel (TEMPLATE_GONE_EXIT), after a grace for the
    reply of a call that has just ended, unless a call has reported it meanwhile: the pool then finds the kernel
    gone before it hands it out (KernelPool._take_ready)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.lock = threading.Lock()
        self.busy = False  # a worker call is being answered
        self.told = False  # an answer has told the pool the template is gone: the pool retires the kernel
        self.last_end = 0.0  # time.monotonic() when the last call was answered
        threading.Thread(target=self._watch, name="stare-template-watch", daemon=True).start()

    def gone(self) -> bool:
        """Whether the template is gone, now: nothing is ever written to the pipe, so readable means end-of-file."""
        return bool(select.select([self.fd], [], [], 0)[0])

    def begin(self) -> bool:
        """A worker call starts; whether the template is gone already."""
        with self.lock:
            self.busy = True
        return self.gone()

    def end(self, told: bool) -> None:
        """The call's answer is made; `told`: it tells the pool that the template is gone."""
        with self.lock:
            self.busy, self.told = False, self.told or told
            self.last_end = time.monotonic()

    def _watch(self) -> None:
        select.select([self.fd], [], [])
        while True:
            with self.lock:
                if self.told:
                    return
                wait = 0.05 if self.busy else self.last_end + _GONE_GRACE_S - time.monotonic()
                if wait <= 0:
                    os._exit(TEMPLATE_GONE_EXIT)
            time.sleep(wait)


class _TemplateLink:
    """The kernel's end of the template's socket: asks for workers and keeps the reports of their ends. Raises
    _RelayFailed when the template is gone (the socket closed) or refuses."""

    def __init__(self, sock: socket.socket, watch: _TemplateWatch):
        self.sock = sock
        self.watch = watch
        self.exits: dict[int, dict] = {}

    def request(self, mode: str, fds: list[int]) -> None:
        """Ask for a worker with these descriptors; `spawned` says which process it is."""
        try:
            socket.send_fds(self.sock, [json.dumps({"mode": mode}).encode()], fds)
        except OSError as exc:
            raise _RelayFailed(f"the template process is gone (asking it for a worker: {exc})", ran=False) from exc

    def spawned(self) -> int:
        while True:
            reply = self._next(None)
            if "spawned" in reply:
                return reply["spawned"]
            if "refused" in reply:  # the template closed its copy of the call's socket: no worker has the code
                raise _RelayFailed(f"the template refused to fork a worker: {reply['refused']}", ran=False)

    def finish(self, pid: int) -> None:
        """Ask the template to end the worker and clean up after it (Template._finish); `ended` says when it did."""
        try:
            self.sock.send(json.dumps({"finish": pid}).encode())
        except OSError as exc:
            raise _RelayFailed(f"the template process is gone (asking it to end worker {pid}: {exc})") from exc

    def ended(self, pid: int, wait_s: float) -> dict:
        """How the worker ended (_ending), once its processes are gone and the scratch dir emptied. Waits up to
        `wait_s` for the template to say."""
        while pid not in self.exits:
            if self._next(wait_s) is None:
                return _ending(unclean=f"the template did not report the end of worker {pid} in {wait_s}s")
        return self.exits.pop(pid)

    def _next(self, wait_s: float | None) -> dict | None:
        readable, _, _ = select.select([self.sock], [], [], wait_s)
        if not readable:
            return None
        try:
            data = self.sock.recv(4096)
        except OSError as exc:
            raise _RelayFailed(f"the template process is gone ({exc})") from exc
        if not data:
            raise _RelayFailed("the template process is gone (its socket closed)")
        reply = json.loads(data)
        if "exited" in reply:
            self.exits[reply["exited"]] = reply
            while len(self.exits) > 64:  # only the latest are ever asked for
                del self.exits[next(iter(self.exits))]
        return reply


class _Relay:
    """The kernel's side of one worker: its output pipes and its socket."""

    def __init__(self, link: _TemplateLink, mode: str):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            link.request(mode, [out_w, err_w, theirs.fileno()])
        except BaseException:
            mine.close()
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        self.link, self.conn, self.pid = link, mine, 0
        self.started = False  # the worker said it began the current call's code (before running any of it)
        self.ending: dict | None = None  # how the worker ended, once the template cleaned up after it
        self.died = False  # it ended on its own
        self.streams = {out_r: (sys.stdout, _decoder()), err_r: (sys.stderr, _decoder())}
        for fd in self.streams:
            os.set_blocking(fd, False)

    def run(self, code: str, call: str) -> dict:
        """Send the cell and relay its output until it is done: the worker's report of this call (it carries
        `call`), or an EXIT_ERROR one when the worker ended first. _RelayFailed when the template is gone or the
        worker answers out of turn."""
        if not self.pid and len(code) > _EARLY_CODE_CHARS:  # could fill the socket before any worker reads it
            self.pid = self.link.spawned()
        self.started = False
        try:  # a first small cell waits in the socket while its worker is handed out
            _send(self.conn, {"code": code, "call": call})
        except OSError as exc:  # no process holds the other end, so none has read this code
            if self.pid:  # the session's worker ended since its last call: the template says how
                return self._ended()
            raise _RelayFailed(f"no worker took the call's socket ({exc})", ran=False) from exc
        self.pid = self.pid or self.link.spawned()
        # The pool's interrupt reaches the worker itself (one process group): here it must not end the relay.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda *_: None) if main else None
        try:
            while True:
                readable, _, _ = select.select([*self.streams, self.conn], [], [])
                self._pump([fd for fd in readable if fd in self.streams])
                if self.conn in readable:
                    try:
                        report = _receive(self.conn)
                    except OSError:  # reset: as good as closed
                        report = None
                    except ValueError as exc:
                        raise _RelayFailed(f"worker {self.pid} sent a report that is not JSON ({exc})") from exc
                    self._pump(list(self.streams))
                    if report is None:
                        return self._ended()
                    if not self.started and isinstance(report, dict) and report.get("started") == call:
                        self.started = True
                        continue
                    if not isinstance(report, dict) or report.get("call") != call or "error" not in report:
                        raise _RelayFailed(f"worker {self.pid} sent a report that is not this call's")
                    return report
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def _pump(self, fds: list[int]) -> None:
        for fd in fds:
            stream, decoder = self.streams[fd]
            while True:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not data:
                    break
                stream.write(decoder.decode(data))
        # No flush here: ipykernel flushes both streams before its reply, and before an error we publish (below)

    def _ended(self) -> dict:
        """The report of a worker that ended without finishing its cell (the template's report of its end says
        how; _RelayFailed when the template is gone too)."""
        self.died = True
        evalue = json.dumps({"status": self.end()["status"], "ran": self.started})
        return {"error": {"ename": EXIT_ERROR, "evalue": evalue, "traceback": []}, "displays": []}

    def end(self) -> dict:
        """End the worker and wait until the template has cleaned up after it (ended); free this side's descriptors.
        The template stops the worker first: closing the socket first would let it exit and tear down its memory
        while the call waits. _RelayFailed when the template is gone (the worker is then killed here)."""
        try:
            if self.ending is None:
                if not self.pid:
                    self.ending = _ending()
                else:
                    if not self.died:
                        self.link.finish(self.pid)
                    self.ending = self.link.ended(self.pid, _END_WAIT_S)
        finally:
            self.close()
        return self.ending

    def close(self) -> None:
        """Free this side's descriptors; kill the worker unless the template has ended it (end)."""
        if self.conn.fileno() < 0:
            return
        self.conn.close()
        for fd in self.streams:
            os.close(fd)
        if self.pid > 0 and self.ending is None:  # never 0: that would signal the kernel's whole process group
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


def _failure(why: str, ran: bool) -> dict:
    """The report of a call the kernel could not run as designed (RELAY_ERROR)."""
    evalue = json.dumps({"ran": ran, "why": why})
    return {"error": {"ename": RELAY_ERROR, "evalue": evalue, "traceback": []}, "displays": []}


def relay_kernel_class(link: _TemplateLink) -> type:
    """ipykernel's kernel, relaying the cells that ask for a worker (WORKER_KEY in their metadata) to one.

    Built here, not at import, so that the pool can import this module's constants without importing ipykernel."""
    from ipykernel.ipkernel import IPythonKernel

    class RelayKernel(IPythonKernel):
        template = link
        _session: _Relay | None = None

        async def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False, **kw):
            mode = (kw.get("cell_meta") or {}).get(WORKER_KEY)
            if mode not in WORKER_MODES:
                return await super().do_execute(code, silent, store_history, user_expressions, allow_stdin, **kw)
            call = self.get_parent().get("header", {}).get("msg_id", "")
            watch = self.template.watch
            # what the workers ended during this call left in the scratch dir, and whether that found the template gone
            self._left: dict = {"scratch_bytes": 0, "unclean": None, "gone": None}
            gone = None
            try:
                try:
                    if watch.begin():
                        raise _RelayFailed("the template process had exited before this call came", ran=False)
                    report = self._run(mode, code, call)
                    gone = self._left["gone"] or ("the template process exited" if watch.gone() else None)
                    if gone is not None and mode == "session":  # the session's worker dies with its template
                        raise _RelayFailed(f"{gone}, and the session's worker with it", ran=True)
                except _RelayFailed as exc:
                    report, gone = _failure(exc.why, bool(exc.ran)), exc.why
                except Exception as exc:  # noqa: BLE001 - a fault of the relay's own: never an answer without a report
                    gone = f"the kernel's relay failed: {type(exc).__name__}: {exc}"
                    report = _failure(gone, True)
                return self._answer(call, report, gone)
            finally:
                watch.end(told=gone is not None)

        def _run(self, mode: str, code: str, call: str) -> dict:
            """Run the call in its worker (a new one, or the session's), or end the session's: the report."""
            if mode != "session":  # end; or a call: one worker at a time (the scratch dir is emptied after each)
                self._end_session()
            if mode == "end":
                return {"error": None, "displays": []}
            relay = self._session if mode == "session" else None
            if relay is None:
                relay = _Relay(self.template, mode)
                if mode == "session":
                    self._session = relay
            try:
                report = relay.run(code, call)
            except _RelayFailed as exc:
                exc.ran = relay.started if exc.ran is None else exc.ran
                if relay is self._session:
                    self._session = None
                relay.close()
                raise
            if mode == "call":
                self._check_end(relay)
            elif report["error"] is not None and report["error"]["ename"] == EXIT_ERROR:
                self._session = None  # it died: the next call starts a new one
                self._check_end(relay)
            return report

        def _answer(self, call: str, report: dict, gone: str | None) -> dict:
            """Publish the worker's displays, what ending workers left (and whether the kernel must retire), the
            confirmation of a call its worker reported (WORKER_DONE_MIME), and its error; the reply."""
            for display in report["displays"]:
                if not {WORKER_END_MIME, WORKER_DONE_MIME} & set(display["data"]):  # only the kernel says those
                    content = {"data": display["data"], "metadata": display["metadata"], "transient": {}}
                    self._publish("display_data", content)
            left = {**self._left, "gone": gone}
            if left["scratch_bytes"] or left["unclean"] or gone:
                self._publish("display_data", {"data": {WORKER_END_MIME: left}, "metadata": {}, "transient": {}})
            error = report["error"]
            if error is None or error["ename"] not in (EXIT_ERROR, RELAY_ERROR):
                confirmed = {"data": {WORKER_DONE_MIME: {"call": call}}, "metadata": {}, "transient": {}}
                self._publish("display_data", confirmed)
            if error is not None:
                sys.stdout.flush()  # the output before the error, as ipykernel's own error does
                sys.stderr.flush()
                self._publish("error", error)
            return self._reply(error)

        def _publish(self, kind: str, content: dict) -> None:
            self.session.send(self.iopub_socket, kind, content, parent=self.get_parent(), ident=self._topic(kind))

        def _end_session(self) -> None:
            if self._session is not None:
                relay, self._session = self._session, None
                self._check_end(relay)

        def _check_end(self, relay: _Relay) -> None:
            """End the worker; keep what it left in the scratch dir and whether that could be removed, for the pool
            (_answer), and that the template is gone, if ending it found that."""
            try:
                ending = relay.end()
            except _RelayFailed as exc:
                self._left["gone"] = exc.why
                return
            self._left["scratch_bytes"] += ending["scratch_bytes"]
            self._left["unclean"] = ending["unclean"] or self._left["unclean"]

        def _reply(self, error: dict | None) -> dict:
            reply = {"status": "ok" if error is None else "error", "execution_count": self.execution_count}
            if error is None:
                reply.update(payload=[], user_expressions={})
            else:
                reply.update(error)
            return reply

    return RelayKernel


if __name__ == "__main__":
    main()
