"""A command that owns kernels and is stopped by a signal leaves no kernel process and no scratch folder.

`stare-agent data make-sft` runs code in in-process kernels; it is started with TMPDIR set to a fresh
folder (where its pool makes its `sandbox-*` root), signalled once kernels exist, and must exit with
128 + the signal after stopping every kernel and removing every scratch folder. A process counts as the
command's when it descends from it or when its command line, environment (kernels get HOME and TMPDIR =
their scratch dir) or cwd names that TMPDIR: kernels of other tests in this process are never counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXIT_S = 60.0  # from the signal to the command's exit (measured: about 1 s, 3 s for SIGINT mid-start)


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


def processes_tied_to(path: Path) -> list[str]:
    """Live processes whose command line, environment or working dir names `path`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (stat := _stat(int(entry))) is None or stat[1] == "Z":
            continue
        texts = []
        try:
            texts.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            texts.append(Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace"))
            texts.append(os.readlink(f"/proc/{entry}/cwd"))
        except OSError:  # gone, or another user's (only root reads every environment)
            pass
        if any(str(path) in text for text in texts):
            found.append(f"{entry}: {texts[0][:200] if texts else '?'}")
    return found


def kernel_dirs(tmp: Path) -> list[Path]:
    return list(tmp.glob("sandbox-*/kernel-*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "delay"),
    [
        (signal.SIGTERM, 0.0),
        (signal.SIGHUP, 0.0),
        (signal.SIGINT, 0.0),
        (signal.SIGTERM, 0.5),
        (signal.SIGTERM, 1.0),
        (signal.SIGTERM, 2.0),
    ],
    ids=["SIGTERM-0s", "SIGHUP-0s", "SIGINT-0s", "SIGTERM-0.5s", "SIGTERM-1s", "SIGTERM-2s"],
)
def test_a_signalled_command_leaves_no_kernel_and_no_scratch(tmp_path, signum, delay):
    """Signalled `delay` seconds after the first kernel process exists: at 0 the pool is still starting kernels,
    around 0.5-1 s the first ones warm up and transcripts start (a kernel client stopped then once made the
    clean-up hang in zmq's context termination), at 2 s transcripts run code."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "x.jsonl"
    argv = [sys.executable, "-m", "stare_agent.cli", "data", "make-sft", "--n", "400", "--out", str(out)]
    env = {**os.environ, "TMPDIR": str(tmp)}
    command = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while not (kernel_dirs(tmp) and descendants(command.pid)):
            assert command.poll() is None, f"the command exited before starting kernels: {command.stderr.read()}"
            assert time.monotonic() < deadline, "no kernel started within 120 s"
            time.sleep(0.02)
        time.sleep(delay)
        started = descendants(command.pid)
        command.send_signal(signum)
        try:
            code = command.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the command did not exit within {EXIT_S:g} s of {signum.name}")
        stderr = command.stderr.read()
        assert code == 128 + signum, f"exit status {code}; stderr: {stderr[-3000:]}"
        assert f"stopped by {signum.name}" in stderr
        assert_nothing_left(tmp, started)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        for pid in alive(started):  # a failed test must not leave kernels running
            os.kill(pid, signal.SIGKILL)


def alive(processes: dict[int, int]) -> list[int]:
    """Those of `processes` (pid -> start time) still running; zombies are dead, only not reaped yet."""
    return [pid for pid, start in processes.items() if (s := _stat(pid)) is not None and s[1] != "Z" and s[2] == start]


def assert_nothing_left(tmp: Path, started: dict[int, int]) -> None:
    # The command waits for its kernels' first processes; a second for the host kernel to end the rest of a
    # PID namespace whose init died.
    deadline = time.monotonic() + 1.0
    while (alive(started) or processes_tied_to(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(started) == [], "processes the command started are still running"
    assert processes_tied_to(tmp) == []
    assert sorted(p.name for p in tmp.iterdir()) == [], "scratch folders were left in TMPDIR"
