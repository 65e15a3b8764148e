"""The kernel's side of a forking kernel (`pool.clean_state: fork`): ipykernel, relaying calls to workers that
its template (stare_sandbox.template) forks, and the protocol by which it answers the pool (kernel.py).

The kernel (the template's parent) runs ipykernel with `relay_kernel_class`. A request whose metadata names
a worker mode is relayed: `call` runs the code in a new worker, ended after it (a stateless run), `session`
in the kernel's one session worker, started by its first call and kept until `end` (variables persist within
it). Either way the reply waits for the template's report, so the pool gets the kernel back clean, or told
(WORKER_END_MIME) that it is not. Other requests (the pool's own warm-up) run in the kernel itself.

The other way round, no call may pass for done without the worker that ran it: a worker reports `started` before
any of a cell's code and `done` after it, both carrying the call's id (the execute request's msg_id), and the kernel
confirms a call to the pool (WORKER_DONE_MIME) only on that `done`. A template found gone (the kernel also watches it
through a pipe only the template writes to, TemplateWatch), a refusal, or a report out of turn is a RELAY_ERROR,
which says whether the code had started; the pool then retires the kernel. A template that dies while no call runs
ends the kernel (TEMPLATE_GONE_EXIT), so the pool replaces it before handing it out. What happens when each of these
processes dies: docs/sandbox.md, "When a kernel's process dies".
"""

from __future__ import annotations

import codecs
import json
import os
import select
import signal
import socket
import sys
import threading
import time

from stare_sandbox.template import receive_message, send_message, worker_ending

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
_END_WAIT_S = 10.0  # for the template to report a worker's end (its leftovers killed, the scratch dir emptied)
_GONE_GRACE_S = 1.0  # after a call, before an idle kernel whose template died exits: its reply is on its way out
_EARLY_CODE_CHARS = 32_768  # a cell up to this size is sent before its worker is known (it fits the socket buffer)


class _RelayFailed(Exception):
    """The kernel could not run a worker call as designed: its template is gone or refused to fork, or a worker broke
    the protocol. `ran`: whether the call's code may have started; None leaves it to the relay (_Relay.started)."""

    def __init__(self, why: str, ran: bool | None = None):
        super().__init__(why)
        self.why, self.ran = why, ran


class TemplateWatch:
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


class TemplateLink:
    """The kernel's end of the template's socket: asks for workers and keeps the reports of their ends. Raises
    _RelayFailed when the template is gone (the socket closed) or refuses."""

    def __init__(self, sock: socket.socket, watch: TemplateWatch):
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
        """How the worker ended (worker_ending), once its processes are gone and the scratch dir emptied. Waits up to
        `wait_s` for the template to say."""
        while pid not in self.exits:
            if self._next(wait_s) is None:
                return worker_ending(unclean=f"the template did not report the end of worker {pid} in {wait_s}s")
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

    def __init__(self, link: TemplateLink, mode: str):
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
            send_message(self.conn, {"code": code, "call": call})
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
                        report = receive_message(self.conn)
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
        return _error_report(EXIT_ERROR, status=self.end()["status"], ran=self.started)

    def end(self) -> dict:
        """End the worker and wait until the template has cleaned up after it (ended); free this side's descriptors.
        The template stops the worker first: closing the socket first would let it exit and tear down its memory
        while the call waits. _RelayFailed when the template is gone (the worker is then killed here)."""
        try:
            if self.ending is None:
                if not self.pid:
                    self.ending = worker_ending()
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


def _error_report(ename: str, **fields: object) -> dict:
    """A report the kernel makes up for a call its worker did not report (EXIT_ERROR, RELAY_ERROR): the error's
    message is the JSON of `fields`."""
    return {"error": {"ename": ename, "evalue": json.dumps(fields), "traceback": []}, "displays": []}


def relay_kernel_class(link: TemplateLink) -> type:
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
                    report, gone = _error_report(RELAY_ERROR, ran=bool(exc.ran), why=exc.why), exc.why
                except Exception as exc:  # noqa: BLE001 - a fault of the relay's own: never an answer without a report
                    gone = f"the kernel's relay failed: {type(exc).__name__}: {exc}"
                    report = _error_report(RELAY_ERROR, ran=True, why=gone)
                self._left["gone"] = gone
                return self._answer(call, report)
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

        def _answer(self, call: str, report: dict) -> dict:
            """Publish the worker's displays, what ending workers left (and whether the kernel must retire: _left),
            the confirmation of a call its worker reported (WORKER_DONE_MIME), and its error; the reply."""
            for display in report["displays"]:
                if not {WORKER_END_MIME, WORKER_DONE_MIME} & set(display["data"]):  # only the kernel says those
                    content = {"data": display["data"], "metadata": display["metadata"], "transient": {}}
                    self._publish("display_data", content)
            left = self._left
            if left["scratch_bytes"] or left["unclean"] or left["gone"]:
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
