"""Evaluation: pass@k against brute force, and end to end over scripted generation and real in-process kernels.

The scripted generator answers by problem text and sample number, so every reward is known and the
report's numbers can be worked out by hand.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from fractions import Fraction

import pytest

from stare_agent import protocol
from stare_agent.agent import AgentConfig, Sample
from stare_agent.data import Problem
from stare_agent.eval import avg_at_k, evaluate, pass_at_k, pass_ks, write_reports
from stare_sandbox.client import SandboxUnavailable
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.pool import PoolSettings

# --- pass@k and avg@k --------------------------------------------------------------------------------------------


def brute_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_matches_enumeration_of_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 is the fraction correct
    assert 0.0 < pass_at_k(1000, 1, 500) <= 1.0  # the binomials would overflow a float
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 0)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)


def test_avg_at_k_and_reported_ks():
    assert avg_at_k([1.0, 0.0, 0.0, 1.0]) == 0.5
    assert avg_at_k([1.0]) == 1.0
    with pytest.raises(ValueError):
        avg_at_k([])
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32]


# --- evaluate end to end -----------------------------------------------------------------------------------------

TOOL = Problem(id="tool", problem="What is 2**10?", answer="1024", source="test")
ALL = Problem(id="all", problem="What is 1+1?", answer="2", source="test")
HALF = Problem(id="half", problem="What is 2+3?", answer="5", source="test")
NONE = Problem(id="none", problem="What is 3+4?", answer="7", source="test")
CUBE = Problem(id="cube", problem="What is 3**3?", answer="27", source="test")


def call(expr):
    return f"Let me compute.\n<code>\n```python\nprint({expr})\n```\n</code>"


def answer(value):
    return f"So the answer is\n{protocol.final_answer(str(value))}"


# First turn of each sample, by problem text and sample number. A tool call's second turn answers what
# the interpreter printed, so the last tool sample (2**10 + 1) is wrong.
FIRST = {
    TOOL.problem: [call("2**10"), call("2**10"), call("2**10"), call("2**10 + 1")],
    ALL.problem: [answer(2)] * 4,
    HALF.problem: [answer(5), answer(6), answer(4), answer(5)],
    NONE.problem: [answer(8)] * 4,
    CUBE.problem: [call("3**3")] * 4,
}


class Scripted:
    """generate_batch over FIRST: a prompt gets its problem's next sample; a prompt after a call gets the answer."""

    def __init__(self, tokenizer, problems):
        self.tokenizer = tokenizer
        self.prompts = {
            tuple(protocol.encode_prompt(tokenizer, protocol.prompt_messages(p.problem))): p.problem for p in problems
        }
        self.next_sample = {p.problem: 0 for p in problems}
        self.batches: list[int] = []

    def __call__(self, batch, max_new_tokens):
        self.batches.append(len(batch))
        return [self.turn(ids) for ids in batch]

    def turn(self, ids):
        problem = self.prompts.get(tuple(ids))
        if problem is not None:
            text = FIRST[problem][self.next_sample[problem]]
            self.next_sample[problem] += 1
        else:  # after a tool call: answer the last interpreter output
            outputs = re.findall(r"<interpreter>\n(.*?)\n</interpreter>", self.tokenizer.decode(ids), re.DOTALL)
            text = answer(outputs[-1])
        token_ids = protocol.encode_segment(self.tokenizer, text)
        finish = "stop" if text.endswith(protocol.STOP_STRINGS) else "eos"
        if finish == "eos":
            token_ids.append(self.tokenizer.eos_token_id)
        return Sample(token_ids, [0.0] * len(token_ids), finish)


async def with_client(body):
    async with InProcessClient(PoolSettings(pool_size=1)) as client:
        return await body(client)


def test_evaluate_scores_writes_report_and_transcripts(tiny_tokenizer, tmp_path):
    problems = [TOOL, ALL, HALF, NONE]
    script = Scripted(tiny_tokenizer, problems)

    async def body(client):
        return await evaluate(
            problems,
            name="tiny",
            k=4,
            tokenizer=tiny_tokenizer,
            generate_batch=script,
            client=client,
            batch_size=8,
            transcripts=2,
            out_dir=tmp_path,
        )

    report = asyncio.run(with_client(body))
    # two problems per chunk: (tool, all) needs a second turn for the tool episodes, (half, none) does not
    assert script.batches == [8, 4, 8]
    assert [r.rewards for r in report.results] == [[1.0, 1.0, 1.0, 0.0], [1.0] * 4, [1.0, 0.0, 0.0, 1.0], [0.0] * 4]
    assert report.results[0].predictions == ["1024", "1024", "1024", "1025"]
    assert report.results[0].tool_calls == [1, 1, 1, 1] and report.results[1].tool_calls == [0, 0, 0, 0]
    # by hand: avg@4 = (3/4 + 1 + 1/2 + 0) / 4; pass@2 = (1 + 1 + (1 - 1/6) + 0) / 4; pass@4 = 3/4
    assert report.problems == 4 and report.samples_per_problem == 4 and report.unscored_problems == 0
    assert report.avg_at_k == pytest.approx(0.5625)
    assert report.pass_at == pytest.approx({1: 0.5625, 2: 17 / 24, 4: 0.75})
    assert report.mean_tool_calls == 0.25 and report.finish_reasons == {"answer": 16} and report.sandbox_errors == 0
    assert report.mean_response_length == pytest.approx(sum(sum(r.response_lengths) for r in report.results) / 16)

    saved = json.loads((tmp_path / "tiny.json").read_text())
    assert saved["report"]["avg_at_k"] == pytest.approx(0.5625) and saved["report"]["pass_at"]["4"] == 0.75
    assert [p["problem_id"] for p in saved["problems"]] == ["tool", "all", "half", "none"]
    assert saved["problems"][2]["rewards"] == [1.0, 0.0, 0.0, 1.0]
    # every sample's programs, not only the transcripts' first sample
    assert (
        saved["problems"][0]["programs"] == [["print(2**10)"]] * 3 + [["print(2**10 + 1)"]]
        and saved["problems"][1]["programs"] == [[]] * 4
    )

    lines = (tmp_path / "tiny_transcripts.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["problem"] == TOOL.problem and first["gold"] == "1024" and first["answer"] == "1024"
    assert first["reward"] == 1.0 and first["finish_reason"] == "answer"
    assert first["turns"] == [
        {"code": "print(2**10)", "status": "ok", "output": "1024"},
        {"code": None, "status": None, "output": None},
    ]
    assert "<interpreter>\n1024\n</interpreter>" in first["response_text"]
    assert second["problem"] == ALL.problem and second["reward"] == 1.0 and len(second["turns"]) == 1

    write_reports([report], tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())[0]["name"] == "tiny"
    table = (tmp_path / "results.md").read_text()
    assert "| benchmark | problems | k | avg@k | pass@1 | pass@k |" in table
    length = f"{report.mean_response_length:.1f}"
    assert f"| tiny | 4 | 4 | 56.2 | 56.2 | 75.0 | {length} | 0.25 | 0 |" in table


def test_batch_smaller_than_k_splits_a_problem_but_scores_the_same(tiny_tokenizer):
    problems = [TOOL, HALF]
    script = Scripted(tiny_tokenizer, problems)

    async def body(client):
        return await evaluate(
            problems, name="tiny", k=4, tokenizer=tiny_tokenizer, generate_batch=script, client=client, batch_size=3
        )

    report = asyncio.run(with_client(body))
    assert max(script.batches) <= 3
    assert [r.rewards for r in report.results] == [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]]
    assert report.pass_at == pytest.approx({1: 0.625, 2: (1 + 5 / 6) / 2, 4: 1.0})


class Failing:
    """Wraps a client; `execute` fails as an unreachable service for code containing one of `markers`."""

    def __init__(self, inner, markers):
        self.inner, self.markers = inner, markers

    async def create_session(self):
        return await self.inner.create_session()

    async def execute(self, code, session_id=None, timeout_s=None):
        if any(marker in code for marker in self.markers):
            raise SandboxUnavailable("cannot reach http://sandbox: connection refused")
        return await self.inner.execute(code, session_id, timeout_s)

    async def close_session(self, session_id):
        await self.inner.close_session(session_id)


def test_sandbox_errors_are_not_scored_as_wrong(tiny_tokenizer, tmp_path):
    problems = [TOOL, NONE, CUBE]
    script = Scripted(tiny_tokenizer, problems)
    config = AgentConfig(sandbox_retries=0, retry_backoff_s=0)

    async def body(client):
        failing = Failing(client, markers=["2**10 + 1", "3**3"])  # tool's last sample and every cube sample
        return await evaluate(
            problems,
            name="flaky",
            k=4,
            tokenizer=tiny_tokenizer,
            generate_batch=script,
            client=failing,
            agent_config=config,
            out_dir=tmp_path,
        )

    report = asyncio.run(with_client(body))
    tool, none, cube = report.results
    assert tool.rewards == [1.0, 1.0, 1.0] and tool.sandbox_errors == 1
    assert tool.finish_reasons == ["answer", "answer", "answer", "sandbox_error"] and tool.predictions[3] is None
    assert none.rewards == [0.0] * 4 and cube.rewards == [] and cube.sandbox_errors == 4
    assert report.problems == 3 and report.unscored_problems == 1 and report.sandbox_errors == 5
    assert report.finish_reasons == {"answer": 7, "sandbox_error": 5}
    # counted as wrong, the failed tool sample would give avg@4 = 3/8 and pass@4 = 1/2; instead tool is
    # scored on its 3 samples, and pass@4 covers only the problem with 4 scoreable samples
    assert report.avg_at_k == pytest.approx(0.5)
    assert report.pass_at == pytest.approx({1: 0.5, 2: 0.5, 4: 0.0})
    assert report.mean_tool_calls == pytest.approx(3 / 7)

    write_reports([report], tmp_path)
    assert "| flaky | 3 | 4 | 50.0 | 50.0 | 0.0 |" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "flaky.json").read_text())["report"]["unscored_problems"] == 1
