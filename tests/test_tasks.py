"""Synthetic tasks: deterministic, train/test disjoint, and each solution snippet prints the answer computed here."""

from __future__ import annotations

import contextlib
import io
import re
import statistics

import pytest

from stare_agent.data import Problem
from stare_agent.lab.tasks import FAMILIES, generate_tasks, split_of


def run_snippet(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue()


def test_same_arguments_same_list_and_seeds_differ():
    first = generate_tasks(48, seed=3)
    assert first == generate_tasks(48, seed=3)
    assert [p.meta for p in first] == [p.meta for p in generate_tasks(48, seed=3)]  # meta is not compared by ==
    assert [p.problem for p in first] != [p.problem for p in generate_tasks(48, seed=4)]
    assert generate_tasks(0) == []


def test_problem_fields():
    for p in generate_tasks(24, split="test"):
        assert isinstance(p, Problem) and p.source == "synthetic"
        assert re.fullmatch(rf"synthetic-test-{p.meta['family']}-[0-9a-f]{{8}}", p.id)
        assert re.fullmatch(r"0|[1-9][0-9]*", p.answer)
        assert set(p.meta) == {"family", "difficulty", "split", "solution_code", "other_solutions"}
        assert p.meta["split"] == "test"
        assert split_of(p.problem) == "test"


def test_train_and_test_are_disjoint_across_seeds():
    train = {p.problem for seed in range(4) for p in generate_tasks(120, seed=seed, split="train")}
    test = {p.problem for seed in range(4) for p in generate_tasks(120, seed=seed, split="test")}
    assert len(train) > 300 and len(test) > 300
    assert not train & test


@pytest.mark.parametrize("split", ["train", "test"])
def test_no_duplicates_and_stable_ids(split):
    problems = generate_tasks(200, seed=1, split=split, difficulty=1)
    assert len({p.problem for p in problems}) == len({p.id for p in problems}) == 200
    # An id depends on the problem only, not on the seed or position that produced it.
    ids = {p.problem: p.id for seed in (1, 2) for p in generate_tasks(200, seed=seed, split=split, difficulty=1)}
    assert all(ids[p.problem] == p.id for p in problems)


@pytest.mark.parametrize(
    ("families", "difficulties"),
    [(FAMILIES, (1, 2, 3)), (("gcd", "mod_pow"), (1, 2, 3)), (FAMILIES[:3], (3, 1, 2)), (FAMILIES[:6], (1, 2))],
)
def test_every_family_and_difficulty_is_represented(families, difficulties):
    def kinds(n: int) -> list[tuple[str, int]]:
        return [
            (p.meta["family"], p.meta["difficulty"])
            for p in generate_tasks(n, families=families, difficulty=difficulties)
        ]

    first = kinds(max(len(families), len(difficulties)))
    assert {f for f, _ in first} == set(families) and {d for _, d in first} == set(difficulties)
    assert set(kinds(len(families) * len(difficulties))) == {(f, d) for f in families for d in difficulties}


def test_single_family_and_difficulty():
    assert {(p.meta["family"], p.meta["difficulty"]) for p in generate_tasks(5, families="gcd", difficulty=3)} == {
        ("gcd", 3)
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_solution_code_prints_the_answer(family, difficulty):
    for p in generate_tasks(3, seed=difficulty, families=[family], difficulty=difficulty):
        assert p.meta["family"] == family and p.meta["difficulty"] == difficulty
        programs = [p.meta["solution_code"], *p.meta["other_solutions"]]
        assert len(set(programs)) == 3, programs  # three different styles
        for code in programs:
            assert run_snippet(code) == p.answer + "\n", (p.problem, code)
            assert code.splitlines()[-1].startswith("print("), code  # the SFT typo episodes edit this line


@pytest.mark.parametrize("family", FAMILIES)
def test_numbers_grow_with_difficulty(family):
    def mean_digits(difficulty: int) -> float:
        problems = generate_tasks(30, families=[family], difficulty=difficulty)
        return statistics.mean(sum(map(len, re.findall(r"\d+", p.problem))) for p in problems)

    assert mean_digits(1) < mean_digits(2) < mean_digits(3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": -1}, "n must be >= 0"),
        ({"split": "dev"}, "split must be one of train, test; got 'dev'"),
        ({"difficulty": 4}, "difficulty must be one of 1, 2, 3"),
        ({"difficulty": [1, 0]}, "difficulty must be one of 1, 2, 3"),
        ({"difficulty": []}, "difficulty must be one of 1, 2, 3"),
        (
            {"families": ["gcd", "primes"]},
            "families must be a non-empty selection of mod_pow, digit_sum_pow, .*'primes'",
        ),
        ({"families": []}, "families must be a non-empty selection of mod_pow"),
    ],
)
def test_bad_arguments_name_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_tasks(**{"n": 5, **kwargs})


def test_exhausted_family_says_so():
    # digit_sum_pow at difficulty 1 has about a hundred distinct texts, a fifth of them in test.
    with pytest.raises(
        ValueError, match="could not draw a new test problem of family 'digit_sum_pow' at difficulty 1"
    ):
        generate_tasks(1000, split="test", families=["digit_sum_pow"], difficulty=1)


def test_sft_transcripts_hold_real_sandbox_output():
    import asyncio

    from stare_agent import protocol
    from stare_agent.lab.tasks import make_sft_rows
    from stare_agent.reward import score
    from stare_sandbox.inprocess import InProcessClient
    from stare_sandbox.pool import PoolSettings

    problems = generate_tasks(len(FAMILIES), seed=3, difficulty=2)

    async def make():
        async with InProcessClient(PoolSettings(pool_size=2)) as client:
            return await make_sft_rows(problems, client, seed=1, error_fraction=0.5)

    rows = asyncio.run(make())
    assert [row["id"] for row in rows] == [p.id for p in problems]
    typos = 0
    for row, problem in zip(rows, problems, strict=True):
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant"] and row["messages"][1]["content"] == problem.problem
        text = row["messages"][2]["content"]
        observations = [s.text for s in protocol.split_transcript(text) if s.kind == "observation"]
        assert observations[-1] == protocol.observation(problem.answer)  # the last call printed the answer
        if len(observations) == 2:
            typos += 1
            assert observations[0] == protocol.observation("NameError: name 'reslt' is not defined")
        assert score(text, problem.answer) == 1.0 and "solution_code" not in row["meta"]
    assert 0 < typos < len(rows)


def test_mixed_style_transcripts_use_every_style_and_one_style_keeps_the_usual_program():
    import asyncio

    from stare_agent import protocol
    from stare_agent.lab.tasks import make_sft_rows
    from stare_agent.reward import score
    from stare_sandbox.inprocess import InProcessClient
    from stare_sandbox.pool import PoolSettings

    problems = generate_tasks(24, seed=5, families=["gcd"], difficulty=2)

    async def make(styles):
        async with InProcessClient(PoolSettings(pool_size=2)) as client:
            return await make_sft_rows(problems, client, seed=1, error_fraction=0.0, styles=styles)

    def programs(rows):  # the model text before the first interpreter output: the one program of the transcript
        return [protocol.split_transcript(row["messages"][2]["content"])[0].text for row in rows]

    one, mixed = asyncio.run(make("one")), asyncio.run(make("mixed"))
    assert all("math.gcd(" in text and "while b" not in text for text in programs(one))
    used = {("math.gcd(" in t) + 2 * ("while b" in t) + 4 * ("sympy.gcd(" in t) for t in programs(mixed)}
    assert used == {1, 2, 4}  # each transcript uses exactly one style, and all three occur
    assert all(score(row["messages"][2]["content"], p.answer) == 1.0 for row, p in zip(mixed, problems, strict=True))
    assert all("other_solutions" not in row["meta"] for row in mixed)
    with pytest.raises(ValueError, match="styles must be one of one, mixed; got 'many'"):
        asyncio.run(make("many"))
