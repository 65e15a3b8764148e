"""benchmarks/bench_dispatch.py's pure pieces, without the stack it runs: the engine's load within a generation
window (against a plain per-millisecond count), the windows from the shim's reports, and the summary and its table
(the runs themselves are the benchmark's, not tested)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("bench_dispatch", BENCHMARKS / "bench_dispatch.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_dispatch"] = bench
spec.loader.exec_module(bench)

SAMPLES = [(10.0, 0), (11.0, 2), (12.0, 0), (13.0, 3), (14.0, 1)]


def per_millisecond(samples, start, end):
    """The slow, obvious version: the count held at each millisecond of the window the samples cover."""
    counts = []
    for ms in range(round(start * 1000), round(end * 1000)):
        t = (ms + 0.5) / 1000
        held = [count for at, count in samples if at <= t]
        if held and t < samples[-1][0]:
            counts.append(held[-1])
    return counts


@pytest.mark.parametrize("window", [(10.5, 13.5), (9.0, 11.5), (12.25, 20.0), (10.0, 14.0), (11.2, 11.7)])
def test_the_load_in_a_window_is_the_held_count_over_the_covered_time(window):
    load = bench.window_load(SAMPLES, *window)
    counts = per_millisecond(SAMPLES, *window)
    assert load["covered_s"] == pytest.approx(len(counts) / 1000)
    assert load["idle_s"] == pytest.approx(counts.count(0) / 1000)
    assert load["in_flight_s"] == pytest.approx(sum(counts) / 1000)


def test_a_window_by_hand_and_one_the_samples_do_not_reach():
    load = bench.window_load(SAMPLES, 10.5, 13.5)  # 0.5 s idle, 1 s of 2, 1 s idle, 0.5 s of 3
    assert load == {"covered_s": 3.0, "idle_s": 1.5, "in_flight_s": 3.5, "samples": 3}
    assert bench.shares([load]) == {"idle_share": 0.5, "mean_in_flight": pytest.approx(3.5 / 3)}
    outside = bench.window_load(SAMPLES, 20.0, 30.0)
    assert outside["covered_s"] == 0 and outside["samples"] == 0
    assert all(math.isnan(value) for value in bench.shares([outside]).values())


def test_shares_over_several_windows_are_weighted_by_time():
    short = {"covered_s": 1.0, "idle_s": 1.0, "in_flight_s": 0.0}
    long = {"covered_s": 3.0, "idle_s": 0.0, "in_flight_s": 12.0}
    assert bench.shares([short, long]) == {"idle_share": 0.25, "mean_in_flight": 3.0}


def test_the_shims_reports_are_read_into_windows(tmp_path):
    load = tmp_path / "engine-load-1.tsv"
    load.write_text("11.0\t2\n10.0\t0\n12.0\t1\n12.5\t")  # the last line cut short by the process's end
    assert bench.read_load(load) == [(10.0, 0), (11.0, 2), (12.0, 1)]
    ends = tmp_path / "generation_ends.jsonl"
    ends.write_text(
        "".join(json.dumps({"pid": 7, "rank": None, "step": s, "time": t}) + "\n" for s, t in [(1, 50.0), (2, 90.0)])
    )
    windows = bench.generation_windows(bench.read_ends(ends), {1: 20.0, 2: 15.0, 3: 9.0})
    assert windows == {1: (30.0, 50.0), 2: (75.0, 90.0)}  # step 3 has no end: no window


def fake_run(mode, generation, idle, consumed, cancelled):
    steps = [
        {"step": step, "generation_s": generation, "prompts_consumed": consumed, "groups_cancelled": cancelled,
         "groups_dropped_sandbox": 0.0, "idle_share": idle,
         "loads": [{"covered_s": generation, "idle_s": idle * generation, "in_flight_s": 2 * generation}]}
        for step in (1, 2)
    ]  # fmt: skip
    return {"mode": mode, "steps": steps, **bench.run_numbers(steps)}


def test_the_summary_takes_medians_over_runs_and_the_table_has_a_row_per_mode_and_the_ratios():
    runs = [
        fake_run("refill", 30.0, 0.4, 6.0, 0.0),
        fake_run("up_front", 10.0, 0.1, 9.0, 2.0),
        fake_run("up_front", 14.0, 0.3, 8.0, 3.0),
        fake_run("refill", 34.0, 0.6, 7.0, 0.0),
    ]
    summary, ratios = bench.summarize(runs)
    assert summary["refill"]["generation_s"] == 32.0 and summary["up_front"]["idle_share"] == pytest.approx(0.2)
    assert summary["up_front"]["per_step"][1] == {"step": 2, "generation_s": 12.0, "idle_share": pytest.approx(0.2)}
    assert ratios["generation_s"] == pytest.approx(32 / 12) and ratios["mean_in_flight"] == pytest.approx(1.0)
    assert math.isnan(
        bench.summarize([fake_run("refill", 1, 0, 1, 0), fake_run("up_front", 1, 0, 1, 0)])[1]["idle_share"]
    )
    settings = {"steps": 2, "prompts_per_step": 4, "group_size": 12, "repeats": 2, "sample_s": 0.02, "pool_size": 1,
                "modes": {"up_front": {"max_dispatch_factor": 3.0, "initial_keep_rate": 0.5}}}  # fmt: skip
    table = bench.markdown(
        {"settings": settings, "other_cores_busy": None, "summary": summary, "refill_over_up_front": ratios}
    )
    assert (
        table.count("| refill |") == 1 and table.count("| up_front |") == 1 and "| refill / up_front | 2.67 |" in table
    )
