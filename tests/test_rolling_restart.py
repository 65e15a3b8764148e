"""A rolling restart of the sandbox servers under load loses no episode.

Two real servers, one multi-server AsyncSandboxClient, EPISODES stateful agent episodes (AT_ONCE at a time), each
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
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest
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
    "--isolation", "process", "--pool-size", "4", "--max-sessions", str(AT_ONCE + 4),
    "--max-kernels", str(AT_ONCE + 8), "--drain-s", str(DRAIN_S),
)  # fmt: skip
"""Per server: each holds every episode at once alone (one is always draining or down)."""


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

    async def create_session(self) -> str:
        self.sessions.append(await self.inner.create_session())
        return self.sessions[-1]

    async def execute(self, code, session_id=None, timeout_s=None):  # noqa: ANN001, ANN201
        try:
            result = await self.inner.execute(code, session_id, timeout_s)
        except SessionNotFound:
            self.lost.append(session_id)
            raise
        if result.status == "sandbox_error":
            self.lost.append(session_id)
        return result

    async def close_session(self, session_id: str) -> None:
        await self.inner.close_session(session_id)


def drain_log(stderr: str) -> tuple[int, list[str]]:
    """(sessions open at the signal, ids of the sessions cut at the deadline) from a drained server's log."""
    opened = re.search(r"draining \(SIGTERM\).*?; (\d+) sessions open", stderr)
    cut = re.search(r"cutting \d+ sessions still open: ([0-9a-f ]*)", stderr)
    assert opened is not None and "drained in" in stderr, stderr[-3000:]
    return int(opened.group(1)), cut.group(1).split() if cut else []


def restart(srv: Server) -> tuple[int, list[str]]:
    """SIGTERM (the server drains and exits), then start it again on its port; what its drain logged."""
    srv.stop(signal.SIGTERM)
    assert srv.proc.returncode == 0, srv.proc.returncode
    logged = drain_log(srv.proc.stderr.read())
    wait_healthy(srv.start(wait=False))
    return logged


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
    config = tmp_path / "server.yaml"
    config.write_text("pool:\n  warmup_code: 'import math'\n")
    servers = [Server("--config", str(config), *FLAGS) for _ in range(2)]
    drains: list[tuple[int, list[str]]] = []

    async def load() -> list[tuple]:
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(seed: int) -> tuple:
            async with gate:
                return await episode(client, tiny_tokenizer, seed)

        async def restarts() -> None:
            for srv in servers:
                await asyncio.sleep(2.0)
                drains.append(await asyncio.to_thread(restart, srv))

        async with AsyncSandboxClient([srv.url for srv in servers]) as client:
            runs = asyncio.gather(*(one(seed) for seed in range(1, EPISODES + 1)))
            _, done = await asyncio.gather(restarts(), runs)
            return done

    try:
        for srv in servers:
            srv.start(wait=False)
        for srv in servers:
            wait_healthy(srv)
        started = time.monotonic()
        done = asyncio.run(load())
        took = time.monotonic() - started
        healths = [httpx.get(f"{srv.url}/healthz", timeout=10).json() for srv in servers]
    finally:
        for srv in servers:
            srv.stop()
    cut = {f"{i}-{sid}" for i, (_, ids) in enumerate(drains) for sid in ids}
    print(f"{EPISODES} episodes in {took:.0f}s; drains (open at the signal, cut): {[(n, len(c)) for n, c in drains]}")

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
