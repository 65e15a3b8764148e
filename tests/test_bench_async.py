"""benchmarks/bench_async.py's pure pieces, without the stack it runs: step times from the log times, each side's
waits in sync and async mode, and the summary and its table (the runs themselves are the benchmark's, not tested)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("bench_async", BENCHMARKS / "bench_async.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_async"] = bench
spec.loader.exec_module(bench)


def test_a_steps_time_is_the_time_since_the_step_before_it_was_logged():
    assert bench.step_seconds({3: 130.0, 1: 100.0, 2: 112.0, 5: 170.0}) == {2: 12.0, 3: 18.0}  # 4 missing: 5 has none
    assert bench.step_seconds({1: 100.0}) == {}


def logged(log_times, **tags):
    """A run's TensorBoard as read_logged gives it: step_total at `log_times`, each other tag's values by step."""
    found = {bench.STEP_TAG: {step: (at, 0.0) for step, at in log_times.items()}}
    for name, values in tags.items():
        tag = "train/" + name.replace("__", "/")
        found[tag] = {step: (log_times[step], value) for step, value in values.items()}
    return found


def test_the_sync_trainer_waits_for_the_generation_and_async_waits_are_the_backends_timers():
    times = {1: 100.0, 2: 110.0, 3: 118.0}
    common = {"timing__generation": {1: 9.0, 2: 6.0, 3: 5.0}, "staleness__lag_max": {2: 0.0, 3: 0.0}}
    generator = {"timing__generator_wait": {2: 4.0, 3: 3.0}}
    sync = bench.step_rows(logged(times, **common, **generator), asynchronous=False)
    assert [(row["step"], row["step_s"], row["trainer_wait_s"], row["generator_wait_s"]) for row in sync] == [
        (2, 10.0, 6.0, 4.0),
        (3, 8.0, 5.0, 3.0),
    ]
    assert math.isnan(sync[0]["ppo_train_s"])  # a tag the run did not log
    waits = {"timing__trainer_wait": {2: 1.0, 3: 2.0}, "timing__generator_wait": {2: 0.5, 3: 0.0}}
    rows = bench.step_rows(logged(times, **common, **waits), asynchronous=True)
    assert [(row["trainer_wait_s"], row["generator_wait_s"]) for row in rows] == [(1.0, 0.5), (2.0, 0.0)]
    numbers = bench.run_numbers(rows)
    assert numbers["step_s"] == 9.0 and numbers["generation_s"] == 5.5 and numbers["lag_max"] == 0.0
    assert numbers["trainer_wait_share"] == pytest.approx(3 / 18)
    assert numbers["generator_wait_share"] == pytest.approx(0.5 / 18)


def fake_run(mode, step_s):
    names = (*bench.SUMMARY, "trainer_wait_s", "generator_wait_s")
    row = {name: 0.5 for name in names} | {"step": 2, "step_s": step_s}
    return {"mode": mode, "steps": [row], **bench.run_numbers([row])}


def test_the_summary_takes_medians_over_runs_and_the_table_has_a_row_per_mode_and_the_ratios():
    runs = [fake_run("sync", s) for s in (10.0, 14.0)] + [fake_run("async", 8.0), fake_run("partial", 6.0)]
    summary, ratios = bench.summarize(runs)
    assert summary["sync"]["step_s"] == 12.0 and summary["sync"]["runs"] == 2
    assert summary["sync"]["per_step"] == [{"step": 2, "step_s": 12.0}]
    assert ratios == {"async": 1.5, "partial": 2.0}
    settings = {"steps": 4, "prompts_per_step": 2, "group_size": 12, "repeats": 2}
    table = bench.markdown({"settings": settings, "other_cores_busy": None, "summary": summary, "sync_over": ratios})
    assert "| sync | 12.0 |  |" in table and "| async | 8.0 | 1.50 |" in table and "| partial | 6.0 | 2.00 |" in table
    assert "| 2 | 12.0 | 8.0 | 6.0 |" in table and "Steps 3 to 3" in table
