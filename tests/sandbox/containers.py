"""The sandbox service's image (sandbox/Containerfile) run with podman, for the tests.

`image()` builds the image from this checkout once per test session (with sandbox/build-image.sh, on a base from
Debian's packages made by sandbox/make-base.sh where that base is absent, or on $STARE_SANDBOX_IMAGE_BASE), and
skips the calling test where podman is not installed. `Container` runs it as docs/sandbox.md's recipe says (plus
--init), with the interface of test_service.Server (url, port, start, stop) plus token, kill, restart, wait, logs,
returncode.

podman gets a containers.conf of ours (cgroupfs, no default ulimits, runc where installed: what the dev VM needs,
docs/dev/sandbox_container.md); $CONTAINERS_CONF, where set, is used instead. Containers are named
`stare-test-<pid of the test process>-<n>`; those of a test process that is gone (killed before its clean-up) are
removed before the first build, and those of this process, if a test left any, when it exits.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from stare_sandbox.app import ServerSettings
from stare_sandbox.ownership import state_dir

from .test_service import free_port

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/stare-sandbox:test"
BASE = "localhost/stare-sandbox-base:latest"
BASE_ENV = "STARE_SANDBOX_IMAGE_BASE"
"""An existing base image to build on instead, e.g. docker.io/library/python:3.11-slim where a registry is reached."""
PREFIX = "stare-test-"
SERVE = ("python", "-m", "stare_sandbox", "serve", "--host", "0.0.0.0", "--port", "8765", "--require-isolation")
"""docs/sandbox.md's command; a Container's own flags follow it."""
PRIVILEGES = ("--cap-add=SYS_ADMIN", "--security-opt=seccomp=unconfined", "--security-opt=apparmor=unconfined")
"""What namespace isolation needs in the container (docs/sandbox.md, "A container")."""
START_TIMEOUT_S = 120.0
STOP_MARGIN_S = 30.0
"""stop() gives the server its drain deadline plus this before podman sends SIGKILL."""

_numbers = itertools.count()
_live: set[str] = set()  # containers this process made and has not removed


@functools.cache
def _env() -> dict[str, str]:
    if os.environ.get("CONTAINERS_CONF"):
        return dict(os.environ)
    folder = tempfile.mkdtemp(prefix="stare-podman-")
    atexit.register(shutil.rmtree, folder, True)
    runtime = 'runtime = "runc"\n' if shutil.which("runc") else ""  # crun refuses the dev VM's hybrid cgroups
    conf = Path(folder, "containers.conf")
    conf.write_text(f'[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\n{runtime}')
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(
    *args: str, check: bool = True, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`podman *args` with our containers.conf; RuntimeError with its stderr if it fails and `check`."""
    done = subprocess.run(
        ["podman", *args], env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} exited with status {done.returncode}: {done.stderr.strip()}")
    return done


def image() -> str:
    """The tag of the sandbox image built from this checkout (once per test session); skips without podman."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman runc mmdebstrap)")
    if os.geteuid() != 0:
        pytest.skip("the container tests run podman as root (the recipe's CAP_SYS_ADMIN is the host's)")
    return _built()


@functools.cache
def _built() -> str:
    remove_leftovers()
    base = os.environ.get(BASE_ENV) or BASE
    if base == BASE and podman("image", "exists", BASE, check=False).returncode != 0:
        _script("make-base.sh", "--tag", BASE)
    _script("build-image.sh", "--base", base, "--tag", IMAGE)
    return IMAGE


def _script(name: str, *args: str) -> None:
    started = time.monotonic()
    # the wheels are this interpreter's: make-base.sh's Debian bookworm has Python 3.11 (build-image.sh checks)
    env = {**_env(), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "sandbox" / name), *args], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"sandbox/{name} {' '.join(args)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    print(f"containers: sandbox/{name} took {time.monotonic() - started:.1f} s", file=sys.stderr)


def remove_leftovers() -> None:
    """Remove the containers of test processes that no longer run (killed before their clean-up)."""
    for name in podman("ps", "--all", "--format", "{{.Names}}").stdout.split():
        owner = name.removeprefix(PREFIX).split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            podman("rm", "--force", "--time", "0", name, check=False)


@atexit.register
def _remove_ours() -> None:
    for name in list(_live):
        podman("rm", "--force", "--time", "0", name, check=False)


class Container:
    """The image run detached as docs/sandbox.md says (plus --init, below), published on a loopback port; the token
    is only in its environment. `args` are server flags, after SERVE; `privileges` replace PRIVILEGES."""

    def __init__(
        self,
        image: str,
        *args: str,
        port: int | None = None,
        token: str | None = None,
        privileges: Sequence[str] = PRIVILEGES,
    ):
        self.image = image
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token or secrets.token_hex(16)
        self.privileges = tuple(privileges)
        self.name = f"{PREFIX}{os.getpid()}-{next(_numbers)}"
        self.created = False
        self._started = time.monotonic()
        self.ready_s: float | None = None
        """Seconds from the last start() to a ready /healthz."""

    def start(self, wait: bool = True) -> Container:
        """Run the container (the first time) or start it again (same name, port and flags); with `wait`, until
        /healthz says ready (`ready`, where the server reports it: a kernel is warm)."""
        self._started = time.monotonic()
        if self.created:
            podman("start", self.name)
        else:
            states = state_dir()  # kernel uid ranges are claimed in the host's state dir, as the recipe's mount says
            states.mkdir(mode=0o700, parents=True, exist_ok=True)
            _live.add(self.name)
            self.created = True
            # --init, which docs/sandbox.md's recipe lacks: with the server as PID 1, every kernel the pool kills
            # (a stuck one, after its timeout) leaves a zombie, its namespace's init, orphaned to the server when
            # `unshare` died first (test_no_zombie_in_the_container)
            podman(
                "run", "--detach", "--init", "--name", self.name, "--publish", f"127.0.0.1:{self.port}:8765",
                *self.privileges, "--cgroupns=private", "--env", "SANDBOX_TOKEN", "--tmpfs", "/tmp:size=1g",
                "--volume", f"{states}:/run/stare-sandbox", self.image, *SERVE, *self.args,
                env={"SANDBOX_TOKEN": self.token},
            )  # fmt: skip
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Wait for /healthz to answer ready; RuntimeError with the server's log if it exits or takes too long."""
        while time.monotonic() < self._started + START_TIMEOUT_S:
            try:
                health = httpx.get(f"{self.url}/healthz", timeout=2)
                if health.status_code == 200 and health.json().get("ready", True):
                    self.ready_s = time.monotonic() - self._started
                    return
            except httpx.TransportError:
                if self.returncode is not None:
                    raise RuntimeError(f"{self.name} exited with status {self.returncode}:\n{self.logs()}") from None
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} was not ready in {START_TIMEOUT_S:g} s:\n{self.logs()}")

    @property
    def drain_s(self) -> float:
        """The server's --drain-s: its flag, else the server's default."""
        for flag, value in itertools.pairwise(self.args):
            if flag == "--drain-s":
                return float(value)
        return ServerSettings().drain_s

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, as `podman stop` sends it, and wait for the exit; SIGKILL after `timeout` seconds (default: the
        server's drain deadline plus STOP_MARGIN_S, so that a stop never cuts a drain). Returns the exit status."""
        timeout = self.drain_s + STOP_MARGIN_S if timeout is None else timeout
        podman("stop", "--time", str(math.ceil(timeout)), self.name, timeout=timeout + 30)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the server (no drain, no clean-up) and wait for the container to stop."""
        podman("kill", self.name, check=False)
        podman("wait", self.name, check=False)

    def restart(self) -> Container:
        """stop(), then start() the same container: same name, port, token and flags."""
        self.stop()
        return self.start()

    def wait(self, timeout: float) -> int:
        """Wait for the server to exit on its own; its exit status."""
        return int(podman("wait", self.name, timeout=timeout).stdout.split()[0])

    @property
    def returncode(self) -> int | None:
        """The server's exit status once the container stopped; None while it runs."""
        state = podman("inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", self.name).stdout.split()
        return None if state[0] == "true" else int(state[1])

    def logs(self) -> str:
        """What the server wrote: its stdout, then its stderr (where its log goes)."""
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run `argv` in the running container (as root, beside the server), checked."""
        return podman("exec", self.name, *argv)

    def remove(self) -> None:
        """Remove the container, killing the server if it still runs."""
        podman("rm", "--force", "--time", "0", self.name, check=False)
        _live.discard(self.name)
