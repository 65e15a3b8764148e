"""Benchmark loaders and the generic problem loader: schemas mapped, bad input named."""

from __future__ import annotations

import json

import pytest

from stare_agent.data import BENCHMARKS, DataError, load_benchmark, load_problems

SIZES = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272, "olympiadbench": 675}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmarks_load_with_their_schemas(name):
    problems = load_benchmark(name)
    assert len(problems) == SIZES[name]
    assert all(p.problem and p.answer and p.source == name for p in problems)
    assert len({p.id for p in problems}) == len(problems)


def test_schema_specifics():
    assert load_benchmark("aime25")[0].answer == "70"
    assert load_benchmark("amc23")[0].answer == "27.0"
    olympiad = load_benchmark("olympiadbench")
    assert any(p.unit for p in olympiad) and not any("$" in p.answer for p in olympiad)
    assert "\\boxed" not in load_benchmark("minerva_math")[0].answer


def test_generic_loader_and_errors(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"q": "1+1?", "a": 2}) + "\n\n" + json.dumps({"q": "2+2?", "a": "4", "id": "x"}) + "\n")
    problems = load_problems(good, problem_field="q", answer_field="a")
    assert [(p.id, p.answer) for p in problems] == [("mine-0", "2"), ("x", "4")]

    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"q": "1"}) + "\n")
    with pytest.raises(DataError, match=r"missing\.jsonl:1: missing field 'a'"):
        load_problems(missing, problem_field="q", answer_field="a")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"q": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"broken\.jsonl:2: not valid JSON"):
        load_problems(broken, problem_field="q", answer_field="q")
    with pytest.raises(DataError, match="unknown benchmark 'aime26'"):
        load_benchmark("aime26")
    with pytest.raises(DataError, match="not found"):
        load_benchmark("aime24", tmp_path)
