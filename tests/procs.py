"""Process helpers for the tests: a census of what outlives its owner (test_signals.py, sandbox/test_lifecycle.py),
read from /proc so it sees processes of any parent; and the sandbox service as a subprocess on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace as NS

REPO = Path(__file__).resolve().parents[1]


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """pid -> start time of every live process below `pid` (start times tell a reused pid apart)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if (stat := _stat(child)) is not None and stat[1] != "Z":
            found[child] = stat[2]
        todo += children.get(child, [])
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def forking_kernel(pid: int) -> dict[str, list[int]]:
    """The processes of the forking kernels at or below `pid` (a kernel's first process, or a server): their relays
    (the kernel processes proper), templates, and the templates' children (workers, spares). All run
    `python -m stare_sandbox.template` (the template and its workers are forks of the kernel)."""
    tree = [child for child in [pid, *descendants(pid)] if "stare_sandbox.template" in cmdline(child)]
    parent = {child: stat[0] for child in tree if (stat := _stat(child)) is not None}
    relays = [child for child in tree if parent.get(child) not in parent]
    templates = [child for child in tree if parent.get(child) in relays]
    return {"relay": relays, "template": templates, "children": [c for c in tree if parent.get(c) in templates]}


def alive(processes: dict[int, int]) -> list[int]:
    """Those of `processes` (pid -> start time) still running; zombies are dead, only not reaped yet."""
    return [pid for pid, start in processes.items() if (s := _stat(pid)) is not None and s[1] != "Z" and s[2] == start]


def processes_tied_to(path: Path) -> list[str]:
    """Live processes whose command line, environment or working dir names `path`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (stat := _stat(int(entry))) is None or stat[1] == "Z":
            continue
        texts = [cmdline(int(entry))]
        try:
            texts.append(Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace"))
            texts.append(os.readlink(f"/proc/{entry}/cwd"))
        except OSError:  # gone, or another user's (only root reads every environment)
            pass
        if any(str(path) in text for text in texts):
            found.append(f"{entry}: {texts[0][:200]}")
    return found


@contextlib.contextmanager
def sandbox_service(pool_size: int, *flags: str, port: int = 0) -> Iterator[NS]:
    """`python -m stare_sandbox serve` on a free loopback port (or `port`), as a node runs it, with more `flags` if
    any: NS(url, proc); stopped after."""
    import httpx

    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(port), "--pool-size", str(pool_size), *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the sandbox service did not start"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield NS(url=url, proc=proc)
    finally:
        stop_service(proc)


def stop_service(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # at once; SIGTERM would drain, waiting for open sessions (--drain-s)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
