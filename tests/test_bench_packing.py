"""benchmarks/bench_packing.py at a tiny size: both ways run the trainer's passes on the same episodes, and the
counts it reports are the micro-batches' (the timings are the benchmark's, not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("bench_packing", BENCHMARKS / "bench_packing.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_packing"] = bench
spec.loader.exec_module(bench)


def test_lengths_are_seeded_and_within_the_range():
    lengths = bench.episode_lengths(50, 96, 2048, seed=3)
    assert lengths == bench.episode_lengths(50, 96, 2048, seed=3) and min(lengths) >= 96 and max(lengths) <= 2048


def test_recorded_lengths_are_a_recorded_runs_episodes_scaled_to_the_budget():
    lengths = bench.recorded_lengths(400, 2048, seed=1)
    assert lengths == bench.recorded_lengths(400, 2048, seed=1) and min(lengths) >= 16 and max(lengths) <= 2048
    recorded = json.loads(bench.RECORDED.read_text())
    pool = {n for problem in recorded["problems"] for n in problem["response_lengths"]}
    assert set(lengths) <= {min(2048, max(16, m * 2048 // bench.RECORDED_BUDGET)) for m in pool}
    assert len(set(lengths)) > 20  # the recorded spread, not one length


def test_a_tiny_run_reports_the_computed_tokens_of_each_way(tmp_path):
    tiny = ["--lengths", "log-uniform", "--episodes", "6", "--min-len", "20", "--max-len", "120", "--micro", "4",
            "--budget", "200"]  # fmt: skip
    bench.main(["--out", str(tmp_path), *tiny, "--hidden", "128", "--layers", "1", "--repeats", "1", "--threads", "1"])
    result = json.loads((tmp_path / "results.json").read_text())
    lengths = bench.episode_lengths(6, 20, 120, seed=0)
    padded, packed = result["summary"]["padded"], result["summary"]["packed"]
    assert packed["computed_per_real_token"] == 1.0
    assert padded["computed_per_real_token"] == 6 * max(lengths) / sum(lengths)  # 2 micro-batches of the longest
    assert padded["micro_batches"] == 2 and packed["micro_batches"] == len(
        bench.micro_batches(lengths, "packed", 4, 200)
    )
    assert (tmp_path / "results.md").read_text().count("| padded") == 2
