"""benchmarks/bench_executor_concurrency.py: the scripted engine under the real executor (a stub sandbox), the
times it reads from the episodes, the table, and one tiny run of the script on real kernels and a real server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from stare_agent import protocol
from stare_agent.backends.openrlhf.episodes import ReToolExecutor
from stare_agent.config import AgentConfig, RLConfig, RolloutConfig
from stare_sandbox.schemas import RunResult

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


bench = _load("bench_executor_concurrency")


class StubClient:
    """A sandbox that answers every call at once with its code's length; records (session, code) per call."""

    def __init__(self):
        self.calls: list[tuple[str | None, str]] = []
        self.sessions = 0

    async def start(self):
        return self

    async def create_session(self) -> str:
        self.sessions += 1
        return f"s{self.sessions}"

    async def execute(self, code, session_id=None, timeout_s=None) -> RunResult:
        self.calls.append((session_id, code))
        await asyncio.sleep(0)
        return RunResult(status="ok", stdout=f"{len(code)}\n", duration_ms=1.0)

    async def close_session(self, session_id) -> None:
        pass

    async def close(self) -> None:
        pass


def _gather(tokenizer, client, numbers, tool_calls, max_tokens=1024):
    """Episodes with these numbers at once through the real executor, as run_cell drives them."""
    config = RLConfig(agent=AgentConfig(max_total_tokens=4096), rollout=RolloutConfig(max_turn_tokens=max_tokens))
    executor = ReToolExecutor(config, make_client=lambda: client)
    labels = {n: str(n % 3) for n in numbers}
    engine = bench.ScriptedEngine(tokenizer, tool_calls, labels)
    traces = [bench.Trace(number=n) for n in numbers]

    async def episode(trace):
        bench.CURRENT.set(trace)
        trace.start = 0.0
        return await executor.execute(
            prompt="Problem: x",
            label=labels[trace.number],
            sampling_params=bench.shared_params(),
            max_length=4096,
            hf_tokenizer=tokenizer,
            llm_engine=engine,
        )

    async def body():
        return await asyncio.gather(*(episode(t) for t in traces))

    return traces, asyncio.run(body())


def test_each_episode_follows_its_own_script_under_gather(tiny_tokenizer):
    client = StubClient()
    traces, responses = _gather(tiny_tokenizer, client, [7, 8, 9], tool_calls=2)
    for trace, response in zip(traces, responses, strict=True):
        logs = response["extra_logs"]
        assert (logs["tool_calls"], logs["finish_answer"], logs["finish_sandbox_error"]) == (2, 1, 0)
        assert response["reward"] == 1.0  # the scripted answer is the label
        assert len(trace.requests) == len(trace.answers) == 3 and trace.grew
    # every episode ran its own code, in turn order, in a session of its own
    by_session: dict[str, list[str]] = {}
    for session, code in client.calls:
        by_session.setdefault(session, []).append(code)
    scripts = [[protocol.parse_tool_call(bench.turn_text(n, turn, 2, "")) for turn in range(2)] for n in (7, 8, 9)]
    assert sorted(by_session.values()) == sorted(scripts)
    assert client.sessions == 3


def test_a_turn_longer_than_max_tokens_is_cut_as_vllm_cuts_it(tiny_tokenizer):
    engine = bench.ScriptedEngine(tiny_tokenizer, 1, {1: "0"})
    bench.CURRENT.set(bench.Trace(number=1))
    params = NS(**{**vars(bench.shared_params()), "stop": list(protocol.STOP_STRINGS), "max_tokens": 5})
    out = asyncio.run(engine.generate([1, 2, 3], params)).outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None
    params.max_tokens, params.stop = 1000, []
    with pytest.raises(RuntimeError, match="stop strings"):
        asyncio.run(engine.generate([1, 2, 3], params))


def _trace(start, requests, answers):
    return bench.Trace(
        number=0, start=start, end=answers[-1] if answers else start, requests=requests, answers=answers
    )


def _response(tool_calls, failed=0, reward=1.0):
    return {
        "extra_logs": {
            "tool_calls": tool_calls,
            "finish_sandbox_error": failed,
            "tool_errors": 0,
            "finish_answer": 1 - failed,
        },
        "reward": 0.0 if failed else reward,
        "scores": math.nan if failed else reward,
    }


def test_call_times_split_first_and_later_calls_and_skip_a_failed_call():
    # episode A: answers at 1, 3, 6, 10 and requests at 0, 2, 5, 9: three calls of 1 s each after the first turn
    a = _trace(0.0, [0.0, 2.0, 5.0, 9.0], [1.0, 3.0, 6.0, 10.0])
    # episode B: its first call failed (sandbox_error): one call made, no request after it
    b = _trace(0.0, [0.5], [1.5])
    first, later, from_start = bench.call_times([a, b], [_response(3), _response(1, failed=1)])
    assert first == [1.0] and later == [2.0, 3.0] and from_start == [2.0]
    row = bench.summarize([a, b], [_response(3), _response(1, failed=1)], wall_s=10.0)
    assert row["sandbox_errors"] == 1 and row["mean_reward"] == 1.0  # the failed one is unscored
    assert row["later_calls_ms"]["max"] == 3000.0 and row["first_call_s"]["p50"] == 1.0


def test_markdown_has_a_row_per_cell_and_dashes_for_missing_times():
    row = {
        "client": "in-process", "mode": "stateful", "sizing": "old", "max_kernels": 64, "episodes": 80,
        "gen_delay_s": 0.0, "scripted_tool_calls": 4, "sandbox_errors": 0, "episodes_with_tool_errors": 0,
        "first_call_s": bench.spread([]), "later_calls_ms": bench.spread([0.1, 0.2], 1000), "wall_s": 9.0,
        "kernels_started": 3, "kernels_alive": 6, "kernel_waiting": 2, "waits_refused": 0, "rejected_429": 0,
        "kernel_memory_mb": 450.0, "others_cores": 0.1,
    }  # fmt: skip
    report = {"rows": [row, {**row, "sizing": "explicit", "max_kernels": 516, "our_cpu_s_per_episode": 1.5}]}
    report["machine"] = {"cores": 2, "memory_gb": 24, "python": "3.11", "sympy": "1.14", "isolation": "process"}
    lines = bench.markdown(report).splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)
    assert "| old (64) | 80 |" in table[2] and "| - / - / - |" in table[2] and "| 150 / 195 |" in table[2]
    assert "| 1.50 |" in table[3]


@pytest.mark.slow
def test_a_tiny_run_on_real_kernels_and_a_real_server(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(bench.signal, "signal", lambda *args: None)  # leave pytest's SIGTERM handling alone
    out = tmp_path / "out"
    argv = ["--levels", "2", "--clients", "server", "--modes", "stateless", "--old-sizing", "2", "--tool-calls", "1"]
    assert bench.main([*argv, "--tokenizer", str(tiny_model_dir), "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["client"], r["mode"], r["sizing"]) for r in rows] == [
        ("server", "stateless", "explicit"),
        ("in-process", "stateful", "old"),
        ("in-process", "stateful", "explicit"),
    ]
    assert [r["max_kernels"] for r in rows[1:]] == [64, 64 * 8 + 4]  # sandbox.max_kernels; 64 x 8 + pool_size
    for r in rows:
        assert r["sandbox_errors"] == 0 and r["finished_with_answer"] == 2 and r["tool_calls"] == 2
        assert r["mean_reward"] == 1.0 and r["ids_grew_every_turn"]
    assert (out / "results.md").read_text().count("| in-process | stateful |") == 2
