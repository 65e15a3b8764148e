"""`python -m stare_sandbox serve [--host H] [--port P] [--token T] [--config FILE] [options]`.

Values come from, in increasing precedence: the defaults in `ServerSettings`/`PoolSettings`/`Limits`,
the YAML `--config` file (ServerSettings' shape: `pool:` and `pool.limits:` nested; validated like the
trainer's configs, so a misspelt key is an error naming file, line and the allowed keys), the
`SANDBOX_TOKEN` environment variable, and the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from stare_sandbox.app import ServerSettings, create_app, open_files_needed, raise_open_files_limit
from stare_sandbox.configfile import ConfigError, load_config
from stare_sandbox.isolation import IsolationMode, detect_isolation
from stare_sandbox.ownership import RangeTaken, StateDirError, check_claimable
from stare_sandbox.pool import CleanState

SERVER_KEEPALIVE_S = 60.0
"""Seconds an idle HTTP connection stays open on the server; several times the clients' KEEPALIVE_S."""

# flag -> (dotted key in ServerSettings, help); defaults are read from ServerSettings() for the help text
FLAGS = {
    "host": ("host", "bind address; any but loopback needs a token"),
    "port": ("port", "TCP port"),
    "token": ("token", "access token clients send as 'Authorization: Bearer ...' (default: $SANDBOX_TOKEN)"),
    "max_running": ("max_running", "calls executing at once"),
    "max_waiting": ("max_waiting", "calls queued for a slot; beyond it 429 with Retry-After"),
    "max_sessions": ("max_sessions", "open stateful sessions; beyond it 503"),
    "session_idle_s": ("session_idle_s", "seconds before an unused session is closed"),
    "drain_s": (
        "drain_s",
        "after SIGTERM: seconds open sessions may go on (new work is refused) before the server cuts them and exits",
    ),
    "pool_size": ("pool.pool_size", "warm kernels kept ready"),
    "max_kernels": ("pool.max_kernels", "kernels alive at once (sessions plus pool)"),
    "max_starting": ("pool.max_starting", "kernels starting at once, in the background (0: no bound, as before)"),
    "queue_wait_s": ("pool.queue_wait_s", "seconds a call waits for a ready kernel; beyond it 503 with Retry-After"),
    "isolation": ("pool.isolation", "auto: namespaces where they work, else process"),
    "clean_state": (
        "pool.clean_state",
        "fork: each stateless call and session in a process forked from a clean template; reset: the pool before",
    ),
    "default_timeout_s": ("pool.default_timeout_s", "wall-clock limit of a call that names none"),
    "max_timeout_s": ("pool.max_timeout_s", "the largest timeout_s a call may ask for"),
    "output_limit_chars": ("pool.output_limit_chars", "stdout and stderr are each cut to this many characters"),
    "run_code_output_limit_bytes": (
        "run_code_output_limit_bytes",
        "POST /run_code keeps the first this many bytes of stdout and of stderr",
    ),
    "memory_mb": ("pool.limits.memory_mb", "address space per kernel process, MiB"),
    "processes": ("pool.limits.processes", "processes and threads per kernel"),
    "file_size_mb": ("pool.limits.file_size_mb", "largest file a kernel may write, MiB"),
    "open_files": ("pool.limits.open_files", "open files per kernel process"),
    "kernel_memory_mb": ("pool.limits.kernel_memory_mb", "memory of all a kernel's processes together, MiB (cgroup)"),
    "call_cpu_s": ("pool.limits.call_cpu_s", "CPU seconds a call may use, all its processes together (0: no cap)"),
    "scratch_mb": ("pool.limits.scratch_mb", "MiB a kernel's working dir may hold (0: no quota)"),
    "uid_base": ("pool.uid_base", "first kernel uid: 61000, 62000, ... 99000 (0: the first range no one holds)"),
}


def build_parser(prog: str = "python -m stare_sandbox") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Python execution sandbox service")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the HTTP service",
        description="Run the HTTP service. Values come from the flags, else --config FILE, else the defaults shown.",
        epilog=CONFIG_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="YAML file shaped like the example below")
    serve.add_argument("--require-isolation", action="store_true", help="refuse to start without namespaces")
    serve.add_argument("--no-cgroups", action="store_true", help="no cgroup per kernel, rlimits only")
    defaults = dataclasses.asdict(ServerSettings())
    for name, (key, text) in FLAGS.items():
        default = functools.reduce(lambda node, part: node[part], key.split("."), defaults)
        kind = str if isinstance(default, str) else float if isinstance(default, float) else int
        shown = "" if name == "token" else f" (default: {default})"
        choices = {"isolation": IsolationMode, "clean_state": CleanState}.get(name)
        options = {"choices": list(get_args(choices))} if choices is not None else {}
        serve.add_argument(f"--{name.replace('_', '-')}", type=kind, help=text + shown, **options)
    return parser


CONFIG_EXAMPLE = """\
A --config file has ServerSettings' shape (unknown keys are refused; flags win over it):

  host: 0.0.0.0        # not loopback: needs --token or $SANDBOX_TOKEN
  port: 8765
  max_running: 8
  pool:
    pool_size: 4
    max_kernels: 64
    max_timeout_s: 120
    limits:
      memory_mb: 4096
      processes: 64
      kernel_memory_mb: 4096
      call_cpu_s: 60
      scratch_mb: 1024
"""


def load_settings(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings from the defaults, the --config file, $SANDBOX_TOKEN and the flags, in that order."""
    values: dict[str, tuple[object, str]] = {}
    if os.environ.get("SANDBOX_TOKEN"):
        values["token"] = (os.environ["SANDBOX_TOKEN"], "$SANDBOX_TOKEN")
    for name, (key, _) in FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            values[key] = (value, f"--{name.replace('_', '-')}")
    if args.require_isolation:
        values["require_isolation"] = (True, "--require-isolation")
    if args.no_cgroups:
        values["pool.cgroups"] = (False, "--no-cgroups")
    try:
        return load_config(ServerSettings, args.config, values=values)
    except ConfigError as exc:
        raise SystemExit(f"sandbox: {exc}") from None


def _draining_server(config, run_drain):  # noqa: ANN001, ANN202 - uvicorn's types are imported late
    """A uvicorn server whose first SIGTERM drains (drain.py) before it exits. SIGINT, a second SIGTERM, or a
    SIGTERM with drain_s 0 exit as uvicorn does: at once, answering the calls running."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None) -> None:  # noqa: ANN001
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
            if sig == signal.SIGTERM and self.loop is not None and self.drain_task is None and not self.should_exit:
                # a signal handler runs between two steps of the event loop's own thread: hand the drain to it
                self.loop.call_soon_threadsafe(self._start_drain)
                return
            if self.drain_task is not None and not self.drain_task.done():
                logging.getLogger("sandbox").warning("signal %d while draining: exiting now", sig)
                self.loop.call_soon_threadsafe(self.drain_task.cancel)
            super().handle_exit(sig, frame)

        def _start_drain(self) -> None:
            if self.drain_task is None:
                self.drain_task = self.loop.create_task(run_drain())
                self.drain_task.add_done_callback(self._drained)

        def _drained(self, task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                logging.getLogger("sandbox").error("the drain failed: %r; exiting", task.exception())
            self.should_exit = True

    return DrainingServer(config)


def main(argv: Sequence[str] | None = None, prog: str = "python -m stare_sandbox") -> int:
    args = build_parser(prog).parse_args(argv)
    settings = load_settings(args)
    if settings.require_isolation:
        if settings.pool.isolation == "process":
            raise SystemExit("sandbox: --require-isolation contradicts --isolation process")
        try:
            detect_isolation("namespaces", cgroups=False)
        except RuntimeError as exc:
            one_line = " ".join(str(exc).split())  # the probe's command holds a program of several lines
            raise SystemExit(f"sandbox: --require-isolation: {one_line}") from None
    try:  # said here in one line; the pool's own claim would end the server with a traceback
        check_claimable(settings.pool.uid_base, settings.pool.max_kernels)
    except (RangeTaken, StateDirError, ValueError) as exc:
        raise SystemExit(f"sandbox: {exc}") from None
    needed = open_files_needed(settings)
    try:
        was, limit = raise_open_files_limit(needed)
    except ValueError as exc:
        raise SystemExit(f"sandbox: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    shown = dataclasses.replace(settings, token="***" if settings.token else "")
    log = logging.getLogger("sandbox")
    log.info("starting with %s", shown)
    log.info("open files: limit %d (was %d), %d needed at most", limit, was, needed)
    # Idle keep-alive connections live longer here than in our clients (KEEPALIVE_S): a request sent on a
    # connection the server is closing at that moment fails after sending, and a session call cannot be retried.
    app = create_app(settings)
    keepalive = SERVER_KEEPALIVE_S
    # uvicorn stops cleanly on SIGINT and SIGTERM only; a hangup (the terminal closed) is made a SIGTERM, unless
    # the server was started with SIGHUP ignored (nohup): then it stays ignored.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda *_: signal.raise_signal(signal.SIGTERM))
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level="warning", timeout_keep_alive=keepalive
    )
    server = _draining_server(config, app.state.run_drain) if settings.drain_s > 0 else uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises SIGINT again once it has stopped: the way out, as uvicorn.run takes it
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
