"""benchmarks/bench_prefix_caching.py without vLLM: the script the model is made to follow, and the summary of
timed batches (the benchmark itself needs vllm and minutes; it is not run here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


bench = _load("bench_prefix_caching")


def test_script_successors_chain_from_the_trigger():
    assert bench.script_successors(9, [1, 2, 3]) == {9: 1, 1: 2, 2: 3}
    # an id that occurs twice with the same successor is fine; the last id needs none (generation stops there)
    assert bench.script_successors(9, [4, 5, 6, 5, 6]) == {9: 4, 4: 5, 5: 6, 6: 5}


@pytest.mark.parametrize("chain", [[1, 2, 1, 3], [1, 9, 2]])
def test_script_successors_refuse_an_id_with_two_successors(chain):
    # the model sees the last id only: 1 -> 2 and 1 -> 3, or the trigger 9 -> 1 and 9 -> 2, cannot both hold
    with pytest.raises(ValueError, match="is followed by"):
        bench.script_successors(9, chain)


def _batch(repeat, mode, wall, sampled=100, prompt=1000, cached=0):
    return {"repeat": repeat, "mode": mode, "wall_s": wall, "sampled_tokens": sampled, "prompt_tokens": prompt,
            "cached_tokens": cached}  # fmt: skip


def test_summary_pairs_batches_by_repeat_and_reports_median_and_range():
    batches = [
        _batch(0, "on", 10.0, cached=600), _batch(0, "off", 20.0),
        _batch(1, "off", 30.0), _batch(1, "on", 10.0, cached=500),
        _batch(2, "on", 20.0, cached=700), _batch(2, "off", 30.0),
        _batch(3, "on", 5.0),  # no "off" batch in repeat 3 (an interrupted run): left out
    ]  # fmt: skip
    summary = bench.summarize(batches)
    assert summary["repeats"] == 3
    assert summary["wall_ratio_off_over_on"] == {"median": 2.0, "min": 1.5, "max": 3.0}
    # the same sampled tokens in both modes: the tokens/s ratio is the wall-time ratio
    assert summary["tokens_per_s_ratio_on_over_off"] == summary["wall_ratio_off_over_on"]
    on = summary["per_mode"]["on"]
    assert on["wall_s"] == {"median": 10.0, "min": 10.0, "max": 20.0}
    assert on["context_tokens"] == {"median": 1000, "min": 1000, "max": 1000}
    assert on["prefill_tokens"] == {"median": 400, "min": 300, "max": 500}
    assert on["cached_fraction"]["median"] == pytest.approx(0.6)
    assert summary["per_mode"]["off"]["cached_fraction"]["max"] == 0.0


def test_summary_needs_a_complete_repeat():
    with pytest.raises(ValueError, match="both modes"):
        bench.summarize([_batch(0, "on", 1.0)])
