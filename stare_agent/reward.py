"""Final-answer extraction and math equivalence: the verifiable reward.

`extract_answer` takes the content of the last `\\boxed{...}` (or `\\fbox{...}`) of a response, with
nested braces, falling back to the last `<answer>...</answer>`. `score` compares it with the gold
answer through math-verify (which parses LaTeX into sympy and checks equivalence: fractions and
decimals, radicals, pi, intervals, sets, tuples, ...). Our own handling is limited to what the
benchmarks need: gold answers given with surrounding `$...$`, and an optional unit.
"""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _braced(text: str, start: int) -> str | None:
    """The text inside the brace that opens just before `start`, honouring nesting; None if unbalanced."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{" and text[i - 1] != "\\":
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The last boxed answer (nested braces allowed), else the last <answer> block's text; None if neither."""
    for match in reversed(list(BOXED.finditer(text))):
        inner = _braced(text, match.end())
        if inner is not None:
            return inner.strip()
    tags = ANSWER_TAG.findall(text)
    if tags:
        inner = tags[-1].strip()
        boxed = extract_answer(inner) if BOXED.search(inner) else None
        return boxed if boxed is not None else inner
    return None


def _strip_dollars(answer: str) -> str:
    answer = answer.strip()
    while len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer[1:-1].strip()
    return answer


def _timeouts() -> dict[str, int | None]:
    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    return {} if threading.current_thread() is threading.main_thread() else {"timeout_seconds": None}


def _parse(answer: str) -> list:
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    kw = _timeouts()
    parsing = {"parsing_timeout": kw["timeout_seconds"]} if kw else {}
    return parse(f"\\boxed{{{answer}}}", extraction_config=configs, **parsing) or parse(
        f"${answer}$", extraction_config=configs, **parsing
    )


def equivalent(prediction: str, gold: str, unit: str | None = None) -> bool:
    """Whether two final answers (LaTeX or plain text, no \\boxed) mean the same value."""
    prediction, gold = _strip_dollars(prediction), _strip_dollars(gold)
    if prediction == gold or prediction.replace(" ", "") == gold.replace(" ", ""):
        return True
    candidates = [prediction]
    if unit:  # "45 minute", "90^{\circ}": also try the answer with the gold's unit removed
        bare = prediction.replace(unit, "").replace("\\text{" + unit.strip() + "}", "").strip()
        candidates.append(bare)
    gold_parsed = _parse(gold)
    if not gold_parsed:
        return False
    return any(verify(gold_parsed, _parse(c), **_timeouts()) for c in candidates if c)


def score(response: str, gold: str, unit: str | None = None) -> float:
    """1.0 if the response's final answer equals the gold answer, else 0.0 (also when there is no answer)."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and equivalent(answer, gold, unit) else 0.0
