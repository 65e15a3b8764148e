"""benchmarks/bench_openrlhf_packing.py at a tiny size, in .venv-openrlhf: the three ways cut the same episodes
(every episode once), the token-budget way by OpenRLHF's own split, and the counts reported are the micro-batches'
(the timings are the benchmark's, not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("bench_openrlhf_packing", BENCHMARKS / "bench_openrlhf_packing.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_openrlhf_packing"] = bench
spec.loader.exec_module(bench)


def test_each_way_holds_every_episode_once_and_the_budget_way_is_openrlhfs():
    lengths = [50, 400, 120, 90, 300, 60, 700, 80, 30]
    for mode in bench.MODES:
        parts = bench.split(lengths, mode, micro=4, budget=800, ranks=2)
        assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert bench.split(lengths, "padded", 4, 800, 2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    budget = bench.split(lengths, "budget", 4, 800, 2)
    assert len(budget) % 2 == 0  # a multiple of the ranks, as OpenRLHF's experience pass makes it
    assert len(budget) == 2  # first fit needs 3 bins of 800 for 1830 tokens; OpenRLHF rounds down to 2


def test_a_tiny_run_reports_the_computed_tokens_of_each_way(tmp_path):
    tiny = ["--lengths", "log-uniform", "--episodes", "6", "--min-len", "20", "--max-len", "120", "--micro", "4",
            "--budget", "200", "--hidden", "128", "--layers", "1", "--repeats", "1", "--threads", "1"]  # fmt: skip
    bench.main(["--out", str(tmp_path), *tiny])
    result = json.loads((tmp_path / "results.json").read_text())
    lengths = [int(x) for x in bench.lengths_of(bench.argparse.Namespace(
        lengths="log-uniform", episodes=6, min_len=20, max_len=120, seed=0))]  # fmt: skip
    summary = result["summary"]
    assert summary["packed"]["computed_per_real_token"] == summary["budget"]["computed_per_real_token"] == 1.0
    padded = 4 * max(lengths[:4]) + 2 * max(lengths[4:])  # each micro-batch padded to its own longest
    assert summary["padded"]["computed_per_real_token"] == pytest.approx(padded / sum(lengths))
    assert summary["padded"]["micro_batches"] == summary["packed"]["micro_batches"] == 2
    assert (tmp_path / "results.md").read_text().count("| padded") == 3
