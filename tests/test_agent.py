"""The agent episode on a real tokenizer and real sandbox kernels (in-process), with scripted generation.

Scripted generation stands in for a model so that every turn's text is known; the sequence, masks,
log-probs and tool results are then checked token for token.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import time

import pytest
from procs import _stat, forking_kernel  # tests/procs.py

from stare_agent import protocol
from stare_agent.agent import AgentConfig, Sample, run_batch, run_episode
from stare_agent.batching import episode_stats, rollout_metrics
from stare_agent.data import Problem
from stare_sandbox.client import SandboxUnavailable
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.pool import PoolSettings

PROBLEM = Problem(id="p1", problem="What is 2**100 mod 7, plus 1?", answer="3", source="test")
CALL_1 = "First the power.\n<code>\n```python\nx = pow(2, 100, 7)\nprint(x)\n```\n</code>"
CALL_2 = "Now add one.\n<code>\n```python\nprint(x + 1)\n```\n</code>"
ANSWER = "So the answer is\n<answer>\n\\boxed{3}\n</answer>"


class Scripted:
    """A generator that replays fixed turns: ids from the tokenizer, random log-probs, the protocol's finish."""

    def __init__(self, tokenizer, turns, seed=0):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.rng = random.Random(seed)
        self.inputs: list[list[int]] = []
        self.samples: list[Sample] = []

    def sample(self, ids, max_new_tokens):
        self.inputs.append(list(ids))
        text = self.turns.pop(0)
        token_ids = protocol.encode_segment(self.tokenizer, text)
        finish = "stop" if text.endswith(protocol.STOP_STRINGS) else "eos"
        if finish == "eos":
            token_ids.append(self.tokenizer.eos_token_id)
        if len(token_ids) >= max_new_tokens:
            token_ids, finish = token_ids[:max_new_tokens], "length"
        sample = Sample(token_ids, [-self.rng.random() for _ in token_ids], finish)
        self.samples.append(sample)
        return sample

    async def __call__(self, ids, max_new_tokens):
        return self.sample(ids, max_new_tokens)


def run(coro):
    return asyncio.run(coro)


async def with_client(body, **settings):
    async with InProcessClient(PoolSettings(pool_size=1, **settings)) as client:
        return await body(client)


def test_two_tool_calls_then_answer(tiny_tokenizer):
    script = Scripted(tiny_tokenizer, [CALL_1, CALL_2, ANSWER])

    async def body(client):
        result = await run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=client)
        assert len(client.sessions) == 0  # the episode's session was closed
        return result

    result = run(with_client(body))
    assert result.finish_reason == "answer" and result.answer == "3" and result.reward == 1.0
    assert [t.code for t in result.turns] == ["x = pow(2, 100, 7)\nprint(x)", "print(x + 1)", None]
    assert [t.output for t in result.turns] == ["2", "3", None]
    assert [t.status for t in result.turns] == ["ok", "ok", None]
    assert result.tool_calls == 2 and result.tool_errors == 0

    # The sequence is prompt + sample + observation + sample + observation + sample, as separate segments.
    prompt = protocol.encode_prompt(tiny_tokenizer, protocol.prompt_messages(PROBLEM.problem))
    obs = [protocol.encode_segment(tiny_tokenizer, protocol.observation(o)) for o in ("2", "3")]
    s = [sample.token_ids for sample in script.samples]
    assert result.token_ids == prompt + s[0] + obs[0] + s[1] + obs[1] + s[2]
    assert result.prompt_len == len(prompt)
    segments = [(prompt, 0), (s[0], 1), (obs[0], 0), (s[1], 1), (obs[1], 0), (s[2], 1)]
    assert result.action_mask == [m for ids, m in segments for _ in ids]
    # generate saw exactly the sequence so far before each turn
    assert script.inputs == [prompt, prompt + s[0] + obs[0], prompt + s[0] + obs[0] + s[1] + obs[1]]
    # log-probs sit on the sampled tokens, zeros elsewhere
    sampled = [lp for lp, m in zip(result.logprobs, result.action_mask, strict=True) if m]
    assert sampled == [lp for sample in script.samples for lp in sample.logprobs]
    assert all(lp == 0.0 for lp, m in zip(result.logprobs, result.action_mask, strict=True) if not m)
    # masked-out response text is exactly the observations, tags included
    response = list(zip(result.token_ids, result.action_mask, strict=True))[result.prompt_len :]
    unmasked = tiny_tokenizer.decode([t for t, m in response if not m])
    assert unmasked == protocol.observation("2") + protocol.observation("3")
    assert tiny_tokenizer.decode([t for t, m in response if m], skip_special_tokens=True) == CALL_1 + CALL_2 + ANSWER


def test_stateless_mode_forgets_variables_and_errors_are_shown(tiny_tokenizer):
    script = Scripted(tiny_tokenizer, [CALL_1, CALL_2, "I give up."])
    config = AgentConfig(tool_mode="stateless")
    result = run(
        with_client(lambda c: run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=c, config=config))
    )
    assert result.turns[1].status == "error" and result.turns[1].output == "NameError: name 'x' is not defined"
    assert result.finish_reason == "eos" and result.reward == 0.0 and result.answer is None
    assert result.tool_errors == 1


def test_tool_limit_ends_the_episode_without_running_the_extra_call(tiny_tokenizer):
    script = Scripted(tiny_tokenizer, [CALL_1, CALL_2, ANSWER])
    config = AgentConfig(max_tool_calls=1)
    result = run(
        with_client(lambda c: run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=c, config=config))
    )
    assert result.finish_reason == "tool_limit" and result.tool_calls == 1 and len(result.turns) == 2
    assert result.turns[1].code is None and result.reward == 0.0
    assert result.token_ids[-len(script.samples[1].token_ids) :] == script.samples[1].token_ids  # no observation


@pytest.mark.parametrize("slack", [0, 3, 40])
def test_token_budget_is_never_exceeded(tiny_tokenizer, slack):
    prompt_len = len(protocol.encode_prompt(tiny_tokenizer, protocol.prompt_messages(PROBLEM.problem)))
    first = len(protocol.encode_segment(tiny_tokenizer, CALL_1))
    # budgets ending inside the first turn, inside its observation, and inside the second turn
    config = AgentConfig(max_total_tokens=prompt_len + first + slack)
    script = Scripted(tiny_tokenizer, [CALL_1, CALL_2, ANSWER])
    result = run(
        with_client(lambda c: run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=c, config=config))
    )
    assert result.finish_reason == "length"
    assert len(result.token_ids) <= config.max_total_tokens
    assert len(result.token_ids) == len(result.action_mask) == len(result.logprobs)


def test_prompt_longer_than_the_budget_is_a_length_finish(tiny_tokenizer):
    script = Scripted(tiny_tokenizer, [])
    result = run(
        with_client(
            lambda c: run_episode(
                PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=c, config=AgentConfig(max_total_tokens=5)
            )
        )
    )
    assert result.finish_reason == "length" and result.turns == [] and script.inputs == []


class Failing:
    """Wraps a client; `execute` fails (as an unreachable service) on the calls whose numbers are listed."""

    def __init__(self, inner, fail_calls):
        self.inner, self.fail_calls, self.calls, self.closed = inner, set(fail_calls), 0, 0

    async def create_session(self):
        return await self.inner.create_session()

    async def execute(self, code, session_id=None, timeout_s=None):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise SandboxUnavailable("cannot reach http://sandbox: connection refused")
        return await self.inner.execute(code, session_id, timeout_s)

    async def close_session(self, session_id):
        self.closed += 1
        await self.inner.close_session(session_id)


def test_sandbox_failure_after_retries_is_sandbox_error_not_a_wrong_answer(tiny_tokenizer):
    script = Scripted(tiny_tokenizer, [CALL_1, ANSWER])
    config = AgentConfig(sandbox_retries=2, retry_backoff_s=0.01)

    async def body(client):
        failing = Failing(client, fail_calls=range(1, 100))
        result = await run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=failing, config=config)
        assert failing.calls == 3  # one try and two retries
        assert len(client.sessions) == 0
        return result

    result = run(with_client(body))
    assert result.finish_reason == "sandbox_error" and result.reward is None
    assert "connection refused" in result.sandbox_error
    assert result.turns[0].status == "sandbox_error"
    assert result.tool_calls == 1 and result.tool_errors == 0  # the sandbox's failure, not the model's code


def test_a_lost_session_is_replayed_before_the_retry(tiny_tokenizer):
    script = Scripted(tiny_tokenizer, [CALL_1, CALL_2, ANSWER])
    config = AgentConfig(retry_backoff_s=0.01)

    async def body(client):
        failing = Failing(client, fail_calls={2})  # the second call fails once; x must survive the retry
        result = await run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=failing, config=config)
        assert failing.calls == 4  # call 1, failed call 2, replay of call 1, call 2
        return result

    result = run(with_client(body))
    assert [t.output for t in result.turns[:2]] == ["2", "3"] and result.reward == 1.0


def test_kernel_death_is_retried_then_reported(tiny_tokenizer):
    crash = "<code>\n```python\nimport os\nos._exit(1)\n```\n</code>"
    script = Scripted(tiny_tokenizer, [crash, ANSWER])
    config = AgentConfig(sandbox_retries=1, retry_backoff_s=0.01)
    result = run(
        with_client(lambda c: run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=c, config=config))
    )
    assert result.finish_reason == "sandbox_error" and result.reward is None and "KernelDied" in result.sandbox_error


def kill_the_template_of_the_only_session(client: InProcessClient) -> None:
    """SIGKILL the template of the kernel that serves the client's one session (as the OOM killer would), and wait
    until the session's worker, which dies with it, is gone: its next call finds a dead template."""
    (session,) = client.sessions._sessions.values()
    found = forking_kernel(session.kernel.process.pid)
    os.kill(found["template"][0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any((stat := _stat(pid)) is not None and stat[1] != "Z" for pid in found["children"]):
        assert time.monotonic() < deadline, "the session's worker outlived its template"
        time.sleep(0.01)


@pytest.mark.parametrize("retries", [0, 2])
def test_a_call_that_finds_its_template_dead_is_a_sandbox_failure_never_an_empty_output(tiny_tokenizer, retries):
    """The template of the episode's kernel dies between its two calls. The second call is a sandbox failure: the
    episode is counted under rollout/finish_sandbox_error and not scored (no retries); or the retry replays the
    session on a new kernel and the model sees the real output. Never an empty observation."""
    script = Scripted(tiny_tokenizer, [CALL_1, CALL_2, ANSWER])
    config = AgentConfig(sandbox_retries=retries, retry_backoff_s=0.01)

    async def body(client):
        async def generate(ids, max_new_tokens):
            if len(script.samples) == 1:  # the first call has run
                await asyncio.to_thread(kill_the_template_of_the_only_session, client)
            return script.sample(ids, max_new_tokens)

        return await run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=generate, client=client, config=config)

    result = run(with_client(body))
    stats = episode_stats(result)
    if retries:
        assert result.finish_reason == "answer" and result.reward == 1.0
        assert [t.output for t in result.turns[:2]] == ["2", "3"] and stats["finish_sandbox_error"] == 0.0
        return
    assert result.finish_reason == "sandbox_error" and result.reward is None
    assert [t.status for t in result.turns] == ["ok", "sandbox_error"] and result.turns[1].output is None
    assert "KernelFailed" in result.sandbox_error or "KernelDied" in result.sandbox_error
    assert stats["finish_sandbox_error"] == 1.0 and math.isnan(stats["reward"])
    assert rollout_metrics([stats])["rollout/finish_sandbox_error"] == 1.0


def test_cancellation_closes_the_session(tiny_tokenizer):
    async def body(client):
        gate = asyncio.Event()
        script = Scripted(tiny_tokenizer, [CALL_1])
        calls = 0

        async def generate(ids, max_new_tokens):
            nonlocal calls
            calls += 1
            if calls == 2:  # the first call has run, the session is open: hang until cancelled
                gate.set()
                await asyncio.sleep(3600)
            return script.sample(ids, max_new_tokens)

        task = asyncio.create_task(run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=generate, client=client))
        await gate.wait()
        assert len(client.sessions) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return len(client.sessions)

    assert run(with_client(body)) == 0


def test_lock_step_batch_runs_a_turns_calls_concurrently(tiny_tokenizer):
    problems = [Problem(id=f"p{i}", problem=f"Print {i}.", answer=str(i), source="test") for i in range(4)]
    scripts = {
        p.problem: Scripted(
            tiny_tokenizer,
            [
                f"<code>\n```python\nv = {i}\nprint(v)\n```\n</code>",
                f"<answer>\n\\boxed{{{i if i % 2 else i + 1}}}\n</answer>",
            ],
        )
        for i, p in enumerate(problems)
    }
    batches = []

    def generate_batch(batch, max_new_tokens):
        batches.append(len(batch))
        samples = []
        for ids, budget in zip(batch, max_new_tokens, strict=True):
            problem = next(p.problem for p in problems if tiny_tokenizer.decode(ids).count(p.problem))
            samples.append(scripts[problem].sample(ids, budget))
        return samples

    class Rendezvous(Failing):
        """Each call waits until all four calls of the turn have arrived: run one at a time, they would hang."""

        arrived, everyone = 0, asyncio.Event()

        async def execute(self, code, session_id=None, timeout_s=None):
            self.arrived += 1
            if self.arrived == len(problems):
                self.everyone.set()
            await asyncio.wait_for(self.everyone.wait(), timeout=60)
            return await super().execute(code, session_id, timeout_s)

    async def body(client):
        rendezvous = Rendezvous(client, fail_calls=())
        results = await run_batch(
            problems, tokenizer=tiny_tokenizer, generate_batch=generate_batch, client=rendezvous, config=AgentConfig()
        )
        assert rendezvous.arrived == 4
        assert len(client.sessions) == 0
        return results

    results = run(with_client(body, max_kernels=8))
    assert batches == [4, 4]
    assert [r.problem_id for r in results] == ["p0", "p1", "p2", "p3"]
    assert [r.reward for r in results] == [0.0, 1.0, 0.0, 1.0]
    assert [r.turns[0].output for r in results] == ["0", "1", "2", "3"]


def test_stop_string_inside_a_token_keeps_the_sampled_ids(tiny_tokenizer):
    """The engine stopped on a token that decodes to `</code>` plus more: the ids stay, the code still runs."""
    script = Scripted(tiny_tokenizer, [CALL_1 + "\n\n", ANSWER])
    script_finish = Scripted.sample

    def sample(self, ids, max_new_tokens):
        out = script_finish(self, ids, max_new_tokens)
        return Sample(out.token_ids, out.logprobs, "stop")

    script.sample = sample.__get__(script)
    result = run(with_client(lambda c: run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=c)))
    assert result.turns[0].output == "2" and result.turns[0].text == CALL_1 + "\n\n"
    first = script.samples[0].token_ids
    assert result.token_ids[result.prompt_len : result.prompt_len + len(first)] == first


def test_the_scorer_is_the_callers_choice(tiny_tokenizer):
    """Default: the gold answer checked inline; a callable of the caller's (given the model's own text and the
    problem, once); or none, for the caller to score."""
    seen = []

    def quarter(text, problem):
        seen.append((text, problem.id))
        return 0.25

    for kwargs, expected in (({}, 1.0), ({"scorer": quarter}, 0.25), ({"scorer": None}, None)):
        script = Scripted(tiny_tokenizer, [CALL_1, ANSWER])

        async def body(client, script=script, kwargs=kwargs):
            return await run_episode(PROBLEM, tokenizer=tiny_tokenizer, generate=script, client=client, **kwargs)

        result = run(with_client(body))
        assert result.finish_reason == "answer" and result.reward == expected
    assert seen == [(CALL_1 + ANSWER, "p1")]
