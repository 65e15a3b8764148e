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
from procs import alive, descendants, processes_tied_to  # tests/procs.py

REPO = Path(__file__).resolve().parents[1]
EXIT_S = 60.0  # from the signal to the command's exit (measured: about 1 s, 3 s for SIGINT mid-start)


def kernel_dirs(tmp: Path) -> list[Path]:
    return list(tmp.glob("sandbox-*/kernel-*"))


def as_a_foreground_job(ignored: tuple[signal.Signals, ...] = ()):
    """A preexec_fn: the command starts with these signals ignored and the others at their default, as a
    terminal's foreground job does, also when this test runs where some are ignored (a background job of a
    shell without job control ignores SIGINT, `nohup` SIGHUP; both are inherited)."""

    def reset() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)

    return reset


def start_make_sft(tmp_path: Path, ignored: tuple[signal.Signals, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """`stare-agent data make-sft` with TMPDIR = tmp_path/tmp; (the process, that TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "x.jsonl"
    argv = [sys.executable, "-m", "stare_agent.cli", "data", "make-sft", "--n", "400", "--out", str(out)]
    env = {**os.environ, "TMPDIR": str(tmp)}
    command = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_foreground_job(ignored),
    )
    return command, tmp


def wait_for_kernels(command: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + 120
    while not (kernel_dirs(tmp) and descendants(command.pid)):
        assert command.poll() is None, f"the command exited before starting kernels: {command.stderr.read()}"
        assert time.monotonic() < deadline, "no kernel started within 120 s"
        time.sleep(0.02)


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
    command, tmp = start_make_sft(tmp_path)
    started: dict[int, int] = {}
    try:
        wait_for_kernels(command, tmp)
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


@pytest.mark.slow
def test_a_signal_ignored_when_the_command_starts_stays_ignored(tmp_path):
    """Started as `nohup` starts a command (SIGHUP ignored), a SIGHUP does not stop it; SIGTERM still does, and
    cleanly. (The command's own SIGHUP handler used to replace the ignore, so a hangup stopped a nohup run.)"""
    command, tmp = start_make_sft(tmp_path, ignored=(signal.SIGHUP,))
    started: dict[int, int] = {}
    try:
        wait_for_kernels(command, tmp)
        command.send_signal(signal.SIGHUP)
        time.sleep(2.0)
        assert command.poll() is None, f"SIGHUP stopped it: {command.stderr.read()[-2000:]}"
        started = descendants(command.pid)
        command.send_signal(signal.SIGTERM)
        code = command.wait(timeout=EXIT_S)
        assert code == 128 + signal.SIGTERM, f"exit status {code}; stderr: {command.stderr.read()[-3000:]}"
        assert_nothing_left(tmp, started)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)


def assert_nothing_left(tmp: Path, started: dict[int, int]) -> None:
    # The command waits for its kernels' first processes; a second for the host kernel to end the rest of a
    # PID namespace whose init died.
    deadline = time.monotonic() + 1.0
    while (alive(started) or processes_tied_to(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(started) == [], "processes the command started are still running"
    assert processes_tied_to(tmp) == []
    assert sorted(p.name for p in tmp.iterdir()) == [], "scratch folders were left in TMPDIR"
