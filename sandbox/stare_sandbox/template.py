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
- the **kernel** (the parent) then runs ipykernel, relaying to workers the calls that ask for one
  (`stare_sandbox.relay`).

A worker inherits every fence of its kernel (namespaces, uid, rlimits, cgroup): it is a process of the same kernel,
in the same process group, so the pool's interrupt, caps and kill reach it as they reach the kernel. Its fd 1 and 2
are pipes the kernel reads and republishes as stream output (also what its child processes print), its fd 0 is
/dev/null, and it talks to the kernel over a socket: the cell's code and the call's id in, then a "started" message
(before any of the code runs) and a "done" one with the cell's error, if any, and the display messages that must
reach the client (fetched files), both with the call's id (send_message). It runs the cell with IPython's
`run_cell` (magics, the last expression's value printed), as the kernel would. The template and every worker get
the parent-death signal: a kernel that dies takes its template and workers with it.
"""

from __future__ import annotations

import base64
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
from typing import Any

from stare_sandbox.isolation import empty_scratch
from stare_sandbox.processes import kill_until_gone, parent_of, process_table

_FRAME = 8  # bytes of the length before each message on a worker socket
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
    # reaches end-of-file the moment the template is gone, however it died (relay.TemplateWatch).
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

    from stare_sandbox.relay import TemplateLink, TemplateWatch, relay_kernel_class

    link = TemplateLink(kernel_end, TemplateWatch(alive_r))
    IPKernelApp.launch_instance(argv=argv[2:], kernel_class=relay_kernel_class(link))


def worker_ending(status: int | None = None, scratch_bytes: int = 0, unclean: str | None = None) -> dict:
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
            send_message(mine, {"code": WARM_CELL})
            receive_message(mine)  # started
            receive_message(mine)  # done
            report = receive_message(mine)
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
        self.sock.send(json.dumps({"exited": pid, **worker_ending(status, *self._empty_scratch())}).encode())
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
            request = receive_message(self.conn)
            if request is None:
                return
            self.error, self.displays = None, []
            send_message(
                self.conn, {"started": request.get("call")}
            )  # before any of its code: the kernel knows it ran
            self.shell.run_cell(request["code"], store_history=False, silent=False)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: S110 - the code closed or replaced it: nothing left to flush
                    pass
            report = {"done": True, "call": request.get("call"), "error": self.error, "displays": self.displays}
            send_message(self.conn, report)
            if self.probe is not None:
                send_message(self.conn, {"warm": own_pages("/proc/self/pagemap", self.probe)})
                return
            if not self.session:  # the kernel has the template stop it (_finish): exiting now would cost the call
                receive_message(self.conn)  # the time its memory takes to tear down
                return


def _read(path: str) -> str:
    with open(path) as source:
        return source.read()


def _text_stream(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(
        io.FileIO(fd, "wb", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )


def send_message(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(len(data).to_bytes(_FRAME, "big") + data)


def receive_message(conn: socket.socket) -> dict | None:
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


if __name__ == "__main__":
    main()
