"""Data: benchmark loaders for the six math test sets, and a generic loader with field mapping.

Each benchmark keeps its original schema (see shared/benchmarks/README.md); the loaders map it to
`Problem`. Files are read from a local folder: nothing is fetched from a model hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stare_agent.reward import extract_answer


class DataError(ValueError):
    """A data file or row is wrong; the message names the file, the line or row, and the field."""


@dataclass(frozen=True)
class Problem:
    id: str
    """Stable id: the benchmark's own id when it has one, else '<benchmark>-<row>'."""
    problem: str
    answer: str
    """Gold final answer, without \\boxed and without surrounding $...$."""
    source: str
    """Benchmark or file it came from."""
    unit: str | None = None
    """Unit of the answer where the benchmark gives one (OlympiadBench)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


def read_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number, record) from a .jsonl file or a .json array; errors name file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON array of records, got {type(rows).__name__}")
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {index}: expected an object, got {type(row).__name__}")
            yield index, row
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected an object, got {type(row).__name__}")
        yield number, row


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    if name not in row or row[name] in (None, ""):
        raise DataError(f"{where}: missing field {name!r} (fields present: {', '.join(sorted(row))})")
    return row[name]


def load_problems(
    path: str | Path, *, problem_field: str = "problem", answer_field: str = "answer", source: str | None = None
) -> list[Problem]:
    """A user file (jsonl or json array) with configurable problem and answer fields."""
    source = source or Path(path).stem
    problems = []
    for number, row in read_records(path):
        where = f"{path}:{number}"
        answer = _field(row, answer_field, where)
        problems.append(
            Problem(
                id=str(row.get("id", f"{source}-{number}")),
                problem=str(_field(row, problem_field, where)),
                answer=str(answer).strip(),
                source=source,
            )
        )
    return problems


def _olympiad(path: Path) -> list[Problem]:
    problems = []
    for number, row in read_records(path):
        where = f"{path}:{number}"
        answers = _field(row, "final_answer", where)
        if not isinstance(answers, list) or not answers:
            raise DataError(f"{where}: field 'final_answer' must be a non-empty list, got {answers!r}")
        # Answers are LaTeX in $...$, several in one string ("$69$,$84$", "$f(n)=n$, $g(n)=1$"): drop the
        # dollars, keep one comma-separated answer per problem.
        parts = [" ".join(str(a).replace("$", " ").split()) for a in answers]
        problems.append(
            Problem(
                id=str(row.get("id", f"olympiadbench-{number}")),
                problem=str(_field(row, "question", where)),
                answer=", ".join(parts),
                source="olympiadbench",
                unit=row.get("unit") or None,
                meta={"answer_type": row.get("answer_type"), "is_multiple_answer": row.get("is_multiple_answer")},
            )
        )
    return problems


def _minerva(path: Path) -> list[Problem]:
    problems = []
    for number, row in read_records(path):
        where = f"{path}:{number}"
        answer = extract_answer(str(_field(row, "solution", where)))
        if answer is None:
            raise DataError(f"{where}: field 'solution' has no \\boxed{{}} answer")
        problems.append(
            Problem(
                id=str(row.get("idx", f"minerva_math-{number}")),
                problem=str(_field(row, "problem", where)),
                answer=answer,
                source="minerva_math",
            )
        )
    return problems


# name -> (file, loader)
BENCHMARKS = {
    "aime24": ("aime24.jsonl", lambda p: load_problems(p, source="aime24")),
    "aime25": (
        "aime25.jsonl",
        lambda p: load_problems(p, problem_field="input", answer_field="output", source="aime25"),
    ),
    "amc23": ("amc23.jsonl", lambda p: load_problems(p, source="amc23")),
    "math500": ("math500.json", lambda p: load_problems(p, problem_field="prompt", source="math500")),
    "minerva_math": ("minerva_math.jsonl", _minerva),
    "olympiadbench": ("olympiadbench.jsonl", _olympiad),
}


def benchmark_dir() -> Path:
    """$STARE_BENCHMARKS_DIR, else the project's shared/benchmarks beside the repository."""
    env = os.environ.get("STARE_BENCHMARKS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "benchmarks"


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[Problem]:
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    filename, loader = BENCHMARKS[name]
    path = Path(data_dir) if data_dir is not None else benchmark_dir()
    if not (path / filename).exists():
        raise DataError(f"benchmark file {path / filename} not found (set STARE_BENCHMARKS_DIR or pass data_dir)")
    return loader(path / filename)
