"""A server's drain: after SIGTERM it takes no new work, lets its open sessions end, then exits.

Draining (`Drain.run`, started by the first SIGTERM, __main__.py):
- new sessions, stateless calls and SandboxFusion runs get 503 with Retry-After and the DRAINING_HEADER (app.py),
  so clients send them to their other servers at once; /healthz says `status: draining`, `ready: false`;
- calls of open sessions, and calls already admitted, run as usual; a session ends when its client closes it;
- when nothing is open, running or waiting any more, or at the deadline (`drain_s` after the signal), the drain
  ends: at the deadline the sessions still open are cut (their ids are logged; a call of one gets 404), the calls
  still running finish, and the sessions are closed. Then the server exits.
Knows nothing about HTTP or signals: app.py asks it whether to refuse, __main__.py starts it and exits after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from stare_sandbox.sessions import SessionStore

log = logging.getLogger("sandbox")

POLL_S = 0.05
"""How often the drain looks whether the server has gone idle."""


class Drain:
    """The drain state of one server; `run` drains it (once)."""

    def __init__(self, drain_s: float):
        self.drain_s = drain_s
        """Seconds open sessions may go on after the signal (ServerSettings.drain_s, checked there)."""
        self.started: float | None = None
        """monotonic time of the signal; None while serving normally."""
        self.deadline_passed = False

    @property
    def draining(self) -> bool:
        return self.started is not None

    def left_s(self) -> float | None:
        """Seconds until the deadline (0 once it passed); None while not draining."""
        if self.started is None:
            return None
        return max(0.0, self.started + self.drain_s - time.monotonic())

    async def run(self, sessions: SessionStore, busy: Callable[[], int]) -> list[str]:
        """Drain: wait until no session is open or opening and `busy()` (calls running or waiting) is 0, or the
        deadline; then cut the sessions left, let the calls running finish, and close the sessions. Returns the ids
        of the sessions cut."""
        if self.started is not None:
            raise RuntimeError("the server is draining already")
        self.started = time.monotonic()
        log.warning(
            "draining (SIGTERM): no new sessions or stateless calls; %d sessions open, %d opening, %d calls "
            "running or waiting; exiting when they end, or in %gs",
            len(sessions),
            sessions.opening,
            busy(),
            self.drain_s,
        )

        def idle() -> bool:
            return not len(sessions) and not sessions.opening and not busy()

        cut: list[str] = []
        while not idle() and self.left_s():
            await asyncio.sleep(POLL_S)
        if not idle():
            while sessions.opening:  # a session asked for before the signal is cut once it has its kernel
                await asyncio.sleep(POLL_S)
            # from here every call of a session gets 404: these, and only these, are cut (no session can be made)
            cut, self.deadline_passed = sessions.ids(), True
            log.warning(
                "drain deadline (%gs) passed: cutting %d sessions still open: %s",
                self.drain_s,
                len(cut),
                " ".join(cut),
            )
            while busy():  # a call running at the deadline is answered, not cut
                await asyncio.sleep(POLL_S)
        await sessions.close_all()
        log.warning("drained in %.1fs; exiting", time.monotonic() - self.started)
        return cut
