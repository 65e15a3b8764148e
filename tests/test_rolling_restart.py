"""A rolling restart of the sandbox servers under load loses no episode.

Two real servers (containers of the sandbox image where podman is installed, as in CI; else processes), one
multi-server AsyncSandboxClient, EPISODES stateful agent episodes (AT_ONCE at a time), each
four state-dependent tool calls paced like a model's turns, then the answer. Meanwhile server A is restarted
(SIGTERM: it drains, exits, starts again on its port), then server B. Checked: every episode answers right with
every call's output right and none ends in sandbox_error; an episode opened a second session (the agent's replay)
only when its first was one a drain cut at its deadline (the server logs their ids), and every cut session whose
episode called it again was replayed; some sessions ended during a drain without a cut; at the end no session is
left open on either server.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest
from sandbox.containers import Container, image
from sandbox.test_multiserver import wait_healthy
from sandbox.test_service import Server
from test_agent import Scripted

from stare_agent.agent import AgentConfig, run_episode
from stare_agent.data import Problem
from stare_sandbox.client import AsyncSandboxClient, SessionNotFound

pytestmark = pytest.mark.slow

EPISODES = 36
AT_ONCE = 12
CALLS = 4
DRAIN_S = 2.5
"""Short, so that some sessions outlive it (cut, then replayed) and some end within it."""
PACE_S = (0.3, 1.5)
"""Seconds a turn takes to 'generate': an episode lasts 1.5-7.5 s."""
FLAGS = (
    "--pool-size", "4", "--max-sessions", str(AT_ONCE + 4), "--max-kernels", str(AT_ONCE + 8),
    "--drain-s", str(DRAIN_S),
)  # fmt: skip
"""Per server: each holds every episode at once alone (one is always draining or down)."""


class Process:
    """A server process (process isolation, kernels importing only math, as the soak test's)."""

    def __init__(self, config: str):
        self.server = Server("--config", config, "--isolation", "process", *FLAGS)
        self.url, self.token = self.server.url, None

    def start(self) -> None:
        self.server.start(wait=False)

    def wait(self) -> None:
        wait_healthy(self.server)

    def drain_then_start(self) -> str:
        """SIGTERM: the server drains and exits (status 0); then started again on its port. Its log."""
        self.server.stop(signal.SIGTERM)
        assert self.server.proc.returncode == 0, self.server.proc.returncode
        log = self.server.proc.stderr.read()
        self.start()
        self.wait()
        return log

    def stop(self) -> None:
        self.server.stop()


class Pod:
    """A container of the sandbox image, run as docs/sandbox.md says (tests/sandbox/containers.py)."""

    def __init__(self, token: str | None):
        self.container = Container(image(), *FLAGS, token=token)
        self.url, self.token = self.container.url, self.container.token

    def start(self) -> None:
        self.container.start(wait=False)

    def wait(self) -> None:
        self.container.wait_ready()

    def drain_then_start(self) -> str:
        """`podman stop` (SIGTERM): the server drains and exits (status 0); then the same container starts again.
        Its log so far (it drains once in the test)."""
        assert self.container.stop() == 0
        log = self.container.logs()
        self.container.start()
        return log

    def stop(self) -> None:
        try:
            if self.container.created:
                self.container.stop(timeout=5)
        finally:
            self.container.remove()


def value(seed: int, step: int) -> int:
    x = seed
    for k in range(1, step):
        x = 7 * x + k
    return x


def turns(seed: int) -> list[str]:
    codes = [f"x = {seed}\nprint(x)"] + [f"x = 7 * x + {k}\nprint(x)" for k in range(1, CALLS)]
    calls = [f"Step {i}.\n<code>\n```python\n{code}\n```\n</code>" for i, code in enumerate(codes)]
    return calls + [f"So\n<answer>\n\\boxed{{{value(seed, CALLS)}}}\n</answer>"]


@dataclass
class Tracked:
    """One episode's view of the shared client: the sessions it opened and the calls that found theirs lost."""

    inner: AsyncSandboxClient
    sessions: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    why: list[str] = field(default_factory=list)

    async def create_session(self) -> str:
        self.sessions.append(await self.inner.create_session())
        return self.sessions[-1]

    async def execute(self, code, session_id=None, timeout_s=None):  # noqa: ANN001, ANN201
        try:
            result = await self.inner.execute(code, session_id, timeout_s)
        except SessionNotFound as exc:
            self.lost.append(session_id)
            self.why.append(f"{time.monotonic():.1f} {session_id}: {exc}")
            raise
        if result.status == "sandbox_error":
            self.lost.append(session_id)
            self.why.append(f"{time.monotonic():.1f} {session_id}: {result.error}")
        return result

    async def close_session(self, session_id: str) -> None:
        await self.inner.close_session(session_id)


def drain_log(stderr: str) -> tuple[int, list[str]]:
    """(sessions open or opening at the signal, ids of the sessions cut at the deadline) from a drained server's
    log."""
    opened = re.search(r"draining \(SIGTERM\).*?; (\d+) sessions open, (\d+) opening", stderr)
    cut = re.search(r"cutting \d+ sessions still open: ([0-9a-f ]*)", stderr)
    assert opened is not None and "drained in" in stderr, stderr[-3000:]
    return int(opened.group(1)) + int(opened.group(2)), cut.group(1).split() if cut else []


async def episode(client: AsyncSandboxClient, tokenizer, seed: int) -> tuple:  # noqa: ANN001
    rng = random.Random(seed)
    script = Scripted(tokenizer, turns(seed), seed=seed)

    async def generate(ids, max_new_tokens):  # noqa: ANN001, ANN202
        await asyncio.sleep(rng.uniform(*PACE_S))
        return script.sample(ids, max_new_tokens)

    tracked = Tracked(client)
    problem = Problem(id=str(seed), problem="x", answer=str(value(seed, CALLS)), source="test")
    config = AgentConfig(max_tool_calls=CALLS)
    result = await run_episode(problem, tokenizer=tokenizer, generate=generate, client=tracked, config=config)
    return seed, result, tracked


def test_a_rolling_restart_under_load_loses_no_episode(tiny_tokenizer, tmp_path):
    if shutil.which("podman"):
        first = Pod(None)
        servers = [first, Pod(first.token)]
    else:
        config = tmp_path / "server.yaml"
        config.write_text("pool:\n  warmup_code: 'import math'\n")
        servers = [Process(str(config)) for _ in range(2)]
    drains: list[tuple[int, list[str]]] = []

    async def load() -> list[tuple]:
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(seed: int) -> tuple:
            async with gate:
                return await episode(client, tiny_tokenizer, seed)

        async def restarts() -> None:
            for srv in servers:
                await asyncio.sleep(2.0)
                drains.append(drain_log(await asyncio.to_thread(srv.drain_then_start)))

        async with AsyncSandboxClient([srv.url for srv in servers], token=servers[0].token) as client:
            runs = asyncio.gather(*(one(seed) for seed in range(1, EPISODES + 1)))
            _, done = await asyncio.gather(restarts(), runs)
            return done

    try:
        for srv in servers:
            srv.start()
        for srv in servers:
            srv.wait()
        started = time.monotonic()
        done = asyncio.run(load())
        took = time.monotonic() - started
        healths = [httpx.get(f"{srv.url}/healthz", timeout=10).json() for srv in servers]
        kind = type(servers[0]).__name__
    finally:
        for srv in servers:
            srv.stop()
    cut = {f"{i}-{sid}" for i, (_, ids) in enumerate(drains) for sid in ids}
    print(
        f"{kind}: {EPISODES} episodes in {took:.0f}s; drains (open at the signal, cut):",
        [(n, len(c)) for n, c in drains],
    )
    print("why sessions were given up:", [why for _, _, t in done for why in t.why])

    assert [r.finish_reason for _, r, _ in done] == ["answer"] * EPISODES
    for seed, result, _ in done:
        assert result.reward == 1.0, (seed, result.answer)
        assert [t.output for t in result.turns[:CALLS]] == [str(value(seed, k)) for k in range(1, CALLS + 1)]
        assert {t.status for t in result.turns[:CALLS]} == {"ok"}
    replayed = {seed for seed, _, t in done if len(t.sessions) > 1}
    cut_then_called = {seed for seed, _, t in done if set(t.lost) & cut}
    for seed, _, tracked in done:  # a session is given up only when a drain cut it, never for another reason
        assert set(tracked.lost) <= cut and set(tracked.sessions[:-1]) <= set(tracked.lost), (seed, tracked)
    assert replayed == cut_then_called, (replayed, cut_then_called)
    assert replayed, f"no session outlived a drain's deadline: this proves little; {drains}"
    assert sum(n - len(c) for n, c in drains) > 0, f"no session ended within a drain; {drains}"
    assert [(h["status"], h["ready"], h["sessions"]) for h in healths] == [("ok", True, 0)] * 2
