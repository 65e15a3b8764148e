"""What an HTTP client of the sandbox knows about its servers: the choice by load, down marks and backoff.

No I/O here: the clients (client.py) make the requests and hand each answer, or transport error, to
`Servers.settle`, which classifies it (`Outcome`) and marks its server down or up again. A down server gets no
new work until a probe of it (GET /healthz, made by the client when `to_probe` says so) succeeds.

A draining server (it answered new work with 503 and the DRAINING_HEADER, or a probe said `status: draining`) is
not down: the calls of the sessions it holds go on there, with their retries, and their answers do not bring it back.
It gets no new work until a probe says it is ready again (`status: ok`, e.g. restarted); it is probed every
`down_backoff_s` meanwhile.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from stare_sandbox.schemas import DRAINING_HEADER

RETRY_STATUS = {429, 503}
DOWN_AFTER_REFUSALS = 3
"""A server that answers this many calls in a row with 429/503 is skipped (marked down) until re-probed."""
MAX_DOWN_S = 30.0
"""Longest pause before a down server is probed again."""


def detail(response: httpx.Response) -> str:
    """The error detail of a FastAPI answer, else the start of its body."""
    try:
        return str(response.json().get("detail"))
    except (ValueError, AttributeError):
        return response.text[:200]


@dataclass(eq=False)
class Server:
    """What this client knows about one server. Changed only under `Servers.lock`."""

    index: int
    url: str
    down_for: float
    """Pause before the next probe, should this server go down; doubles while it stays down."""
    up: bool = True
    draining: bool = False
    """Shutting down: no new work (see the module docstring); cleared by a probe saying ready."""
    unreachable: bool = False
    """Down because it could not be connected to: with several servers, a session call there gets one try, not the
    retries, until the next probe."""
    retry_at: float = 0.0
    """When down: monotonic time of the next probe."""
    probing: bool = False
    last_error: str = ""
    refusals: int = 0
    """429/503 answers in a row."""
    in_flight: int = 0
    sessions: int = 0
    """Sessions this client opened there and has not closed."""
    calls: int = 0
    """Requests this client sent there (probes excluded)."""

    @property
    def takes_new_work(self) -> bool:
        return self.up and not self.draining


Outcome = Literal["ok", "refused", "unreachable", "failed"]
"""ok: an answer to hand on (2xx, or a 4xx the client reports); refused: 429/503 with Retry-After, nothing ran;
unreachable: no connection or 503 without Retry-After, nothing ran; failed: broken after sending or 5xx,
the call may have run."""


class Servers:
    """The server list and its bookkeeping: choice by load, down marks, backoff. No I/O here."""

    def __init__(self, urls: tuple[str, ...], down_backoff_s: float):
        self.list = [Server(i, url, down_backoff_s) for i, url in enumerate(urls)]
        self.down_backoff_s = down_backoff_s
        self.lock = threading.Lock()
        self._turn = 0

    def pick(self, avoid: set[int], by_sessions: bool) -> Server | None:
        """The least loaded up server not in `avoid`, counted as in flight; ties in turn. None: no such server."""
        with self.lock:
            up = [s for s in self.list if s.takes_new_work and s.index not in avoid]
            if not up:
                return None
            load = {s.index: (s.sessions, s.in_flight) if by_sessions else (s.in_flight,) for s in up}
            least = min(load.values())
            tied = [s for s in up if load[s.index] == least]
            server = min(tied, key=lambda s: (s.index - self._turn) % len(self.list))
            self._turn = server.index + 1
            server.in_flight += 1
            server.calls += 1
            return server

    def begin(self, server: Server) -> None:
        with self.lock:
            server.in_flight += 1
            server.calls += 1

    def end(self, server: Server) -> None:
        with self.lock:
            server.in_flight -= 1

    def to_probe(self, all_down: bool, avoid: set[int] = frozenset()) -> list[Server]:
        """Down or draining servers to probe now, marked as being probed: those whose pause is over, or (all_down,
        when no server takes new work) every such one not in `avoid`."""
        now = time.monotonic()
        with self.lock:
            if all_down and any(s.takes_new_work for s in self.list):
                return []
            due = [
                s
                for s in self.list
                if not s.takes_new_work and not s.probing and s.index not in avoid and (all_down or now >= s.retry_at)
            ]
            for s in due:
                s.probing = True
            return due

    def claim_all(self) -> list[Server]:
        """Every server, marked as being probed (for health(), which wants each one's answer)."""
        with self.lock:
            for s in self.list:
                s.probing = True
            return list(self.list)

    def probed(self, server: Server, error: str | None, *, unreachable: bool = False, draining: bool = False) -> None:
        """Record a probe's outcome: `error` None when it answered alive, `draining` when it said so."""
        with self.lock:
            server.probing = False
            if error is None:
                server.up, server.unreachable, server.refusals = True, False, 0
                self._set_draining(server, draining)
            else:
                server.draining = False  # gone: down, as any server that does not answer
                self._down(server, error, unreachable, again=True)

    def _set_draining(self, server: Server, draining: bool) -> None:
        server.draining = draining
        if draining:
            server.retry_at = time.monotonic() + self.down_backoff_s

    def unprobed(self, server: Server) -> None:
        """A probe was abandoned (cancelled): leave the server as it was."""
        with self.lock:
            server.probing = False

    def settle(
        self, server: Server, response: httpx.Response | None, error: Exception | None, method: str, path: str
    ) -> tuple[Outcome, str]:
        """Classify an answer (or transport error) of `server` to `method path`; update what is known of it."""
        where = f"{method} {server.url}{path}"
        with self.lock:
            if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
                message = f"cannot reach {server.url}{path}: {error}"
                self._down(server, message, unreachable=True)
                return "unreachable", message
            if error is not None:
                message = f"{where} failed after sending: {type(error).__name__}: {error}"
                self._down(server, message, unreachable=False)
                return "failed", message
            status = response.status_code
            message = f"{where}: HTTP {status}: {detail(response)}"
            if status == 503 and response.headers.get(DRAINING_HEADER):
                server.last_error = message
                if not server.draining:
                    self._set_draining(server, True)
                return "refused", message
            if status in RETRY_STATUS and (status == 429 or response.headers.get("retry-after")):
                server.refusals += 1
                server.last_error = message
                if server.refusals >= DOWN_AFTER_REFUSALS:
                    self._down(server, f"{message} ({server.refusals} refusals in a row)", unreachable=False)
                return "refused", message
            if status == 503:  # without Retry-After: a proxy saying the server is gone; the call was not run
                self._down(server, message, unreachable=True)
                return "unreachable", message
            if status >= 500:
                self._down(server, message, unreachable=False)
                return "failed", message
            server.up, server.unreachable, server.refusals = True, False, 0
            server.down_for = self.down_backoff_s
            return "ok", ""

    def _down(self, server: Server, error: str, unreachable: bool, again: bool = False) -> None:
        server.last_error = error
        server.unreachable = unreachable
        if server.up or again:  # a second failure seen while already down does not push the probe further off
            server.up = False
            server.retry_at = time.monotonic() + server.down_for
            server.down_for = min(2 * server.down_for, MAX_DOWN_S)

    def known_unreachable(self, server: Server) -> bool:
        """Whether a connection to `server` failed and no probe has answered since (until its next probe)."""
        with self.lock:
            return not server.up and server.unreachable and time.monotonic() < server.retry_at

    def opened(self, server: Server, delta: int) -> None:
        with self.lock:
            server.sessions = max(0, server.sessions + delta)

    def unavailable(self) -> str:
        """Why no server took a call (the client's SandboxUnavailable): each server's last error, or the one."""
        with self.lock:
            errors = [s.last_error or f"{s.url}: no answer" for s in self.list]
        if len(errors) == 1:
            return errors[0]
        listed = "; ".join(f"[{i}] {error}" for i, error in enumerate(errors))
        return f"none of the {len(errors)} sandbox servers took the call: {listed}"

    def stats(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {
                    "url": s.url,
                    "up": s.up,
                    "draining": s.draining,
                    "calls": s.calls,
                    "in_flight": s.in_flight,
                    "sessions": s.sessions,
                    "last_error": s.last_error,
                }
                for s in self.list
            ]
