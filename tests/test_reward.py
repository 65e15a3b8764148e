"""Answer extraction and math equivalence, including every gold answer of the six benchmarks."""

from __future__ import annotations

import pytest
from math_verify import verify

from stare_agent.data import BENCHMARKS, load_benchmark
from stare_agent.reward import _parse, equivalent, extract_answer, score


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{a}{b}} and finally \\boxed{3}", "3"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("\\boxed {5}", "5"),
        ("\\boxed{\\text{a{b}c}}", "\\text{a{b}c}"),
        ("<answer>\n\\boxed{7}\n</answer>", "7"),
        ("<answer>42</answer>", "42"),
        ("\\boxed{unbalanced", None),
        ("no answer at all", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "3/4"),
    ("27", "27.0"),
    ("-\\frac{1}{3}", "-1/3"),
    ("1,000", "1000"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("3\\sqrt{3}", "\\sqrt{27}"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("90^\\circ", "90"),
    ("10\\%", "10"),
    ("[1,2)", "[1, 2)"),
    ("(-\\infty, 3]", "x \\le 3"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"),
    ("(1,2)", "(1, 2)"),
    ("x^2+2x+1", "(x+1)^2"),
    ("y=2x+1", "2x+1"),
    ("\\text{even}", "even"),
    ("2, 3", "3, 2"),
    ("$5$", "5"),
]
NOT_EQUIVALENT = [
    ("1/2", "0.51"),
    ("0.333", "1/3"),
    ("27", "28"),
    ("\\sqrt{2}", "1.414"),
    ("[1,2)", "(1,2)"),
    ("(1,2)", "(2,1)"),
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("x^2", "x^3"),
    ("\\text{odd}", "even"),
]


@pytest.mark.parametrize("prediction, gold", EQUIVALENT)
def test_equivalent_forms(prediction, gold):
    assert equivalent(prediction, gold)
    assert score(f"The answer is \\boxed{{{prediction}}}.", gold) == 1.0


@pytest.mark.parametrize("prediction, gold", NOT_EQUIVALENT)
def test_different_values(prediction, gold):
    assert not equivalent(prediction, gold)
    assert score(f"\\boxed{{{prediction}}}", gold) == 0.0


def test_units_and_missing_answers():
    assert equivalent("45 \\text{minute}", "45", unit="minute")
    assert equivalent("45 \\text{ minutes}", "45")
    assert score("I give up", "3") == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_gold_answer_scores_against_itself(name):
    """Each gold answer, boxed, scores 1; and math-verify itself parses it and verifies it (no string shortcut)."""
    problems = load_benchmark(name)
    assert problems
    for problem in problems:
        assert score(f"\\boxed{{{problem.answer}}}", problem.answer, problem.unit) == 1.0, problem.id
        parsed = _parse(problem.answer)
        assert parsed and verify(parsed, _parse(problem.answer)), (problem.id, problem.answer)
