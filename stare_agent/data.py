"""Data: SFT transcripts to token ids and loss masks, RL prompt sets, and the six benchmark loaders.

Records are read from .jsonl, a .json array, or .parquet; every error names the file, the line or
row, and the field. SFT transcripts are tokenized segment by segment exactly as the agent builds
RL sequences (protocol.split_transcript / encode_segment), so SFT trains on the ids RL will show.
The six benchmark files ship with the project in data/benchmarks (schemas, sources and licenses in
data/benchmarks/README.md); each keeps its original schema and the loaders map it to `Problem`.
Files are read from a local folder: nothing is fetched from a model hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stare_agent import protocol
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


def read_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) from a .jsonl file, a .json array or a .parquet file.

    `where` is "file:line" for jsonl, "file: row N" (from 0) for json arrays and parquet, ready to
    prefix an error message.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
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
            yield f"{path}: row {index}", row
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
        yield f"{path}:{number}", row


def _parquet_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq  # only parquet users pay for the import

    try:
        table = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError) for non-parquet bytes
        raise DataError(f"cannot read {path} as parquet: {exc}") from None
    index = 0
    for batch in table.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{path}: row {index}", row
            index += 1


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    if name not in row or row[name] in (None, ""):
        raise DataError(f"{where}: missing field {name!r} (fields present: {', '.join(sorted(row))})")
    return row[name]


def _id(row: dict[str, Any], name: str, default: str) -> str:
    # parquet gives None for a column a row lacks; an empty id is as good as none
    value = row.get(name)
    return default if value is None or value == "" else str(value)


def load_problems(
    path: str | Path, *, problem_field: str = "problem", answer_field: str = "answer", source: str | None = None
) -> list[Problem]:
    """An RL prompt set or a user's test file (jsonl, json array or parquet) with configurable problem and
    answer fields; a record's `id` field is kept, else ids are '<source>-<index>'."""
    source = source or Path(path).stem
    problems = []
    for where, row in read_records(path):
        answer = _field(row, answer_field, where)
        problems.append(
            Problem(
                id=_id(row, "id", f"{source}-{len(problems)}"),
                problem=str(_field(row, problem_field, where)),
                answer=str(answer).strip(),
                source=source,
            )
        )
    return problems


def _olympiad(path: Path) -> list[Problem]:
    problems = []
    for where, row in read_records(path):
        answers = _field(row, "final_answer", where)
        if not isinstance(answers, list) or not answers:
            raise DataError(f"{where}: field 'final_answer' must be a non-empty list, got {answers!r}")
        # Answers are LaTeX in $...$, several in one string ("$69$,$84$", "$f(n)=n$, $g(n)=1$"): drop the
        # dollars, keep one comma-separated answer per problem.
        parts = [" ".join(str(a).replace("$", " ").split()) for a in answers]
        problems.append(
            Problem(
                id=_id(row, "id", f"olympiadbench-{len(problems)}"),
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
    for where, row in read_records(path):
        answer = extract_answer(str(_field(row, "solution", where)))
        if answer is None:
            raise DataError(f"{where}: field 'solution' has no \\boxed{{}} answer")
        problems.append(
            Problem(
                id=_id(row, "idx", f"minerva_math-{len(problems)}"),
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


DEFAULT_BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
"""The benchmark files shipped in the repository (data/benchmarks), found from this file's location.
A wheel installed without the repository does not hold them: point STARE_BENCHMARKS_DIR at a copy."""

BENCHMARKS_ENV = "STARE_BENCHMARKS_DIR"
_HOW_TO_POINT = (
    f"pass data_dir to load_benchmark, set eval data_dir in the config, or set {BENCHMARKS_ENV} to a folder "
    "holding the benchmark files (the repository ships all six in data/benchmarks)"
)


def _resolve_benchmark_dir(data_dir: str | Path | None) -> tuple[Path, str]:
    """(folder, where the choice came from): data_dir, else $STARE_BENCHMARKS_DIR, else the shipped folder."""
    if data_dir is not None:
        return Path(data_dir), "the data_dir argument"
    env = os.environ.get(BENCHMARKS_ENV)
    if env:
        return Path(env), f"${BENCHMARKS_ENV}"
    return DEFAULT_BENCHMARKS_DIR, "the default, the repository's data/benchmarks"


def benchmark_dir(data_dir: str | Path | None = None) -> Path:
    """Folder the benchmark files are read from: `data_dir` when given, else $STARE_BENCHMARKS_DIR when set
    and not empty, else DEFAULT_BENCHMARKS_DIR (the repository's data/benchmarks)."""
    return _resolve_benchmark_dir(data_dir)[0]


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[Problem]:
    """One of BENCHMARKS as `Problem`s, read from `benchmark_dir(data_dir)`.

    A missing folder or file raises DataError naming the path, where it came from, and how to point
    at another folder.
    """
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    filename, loader = BENCHMARKS[name]
    folder, origin = _resolve_benchmark_dir(data_dir)
    if not folder.is_dir():
        raise DataError(f"benchmark folder {folder} (from {origin}) not found; {_HOW_TO_POINT}")
    path = folder / filename
    if not path.is_file():
        raise DataError(f"benchmark file {path} (from {origin}) not found; {_HOW_TO_POINT}")
    return loader(path)


# --- SFT transcripts ----------------------------------------------------------------------------------------------

Truncation = Literal["right", "drop", "error"]


@dataclass(frozen=True)
class SFTExample:
    id: str
    input_ids: list[int]
    """Prompt, then the transcript's segments tokenized one by one, then EOS."""
    loss_mask: list[int]
    """Same length; 1 = text the model writes (trained on), 0 = prompt and interpreter output, tags included."""
    where: str
    """File and line/row it came from."""
    truncated: bool = False


@dataclass
class SFTReport:
    """What loading a transcript file did: nothing is dropped without being counted here."""

    rows: int = 0
    truncated: int = 0
    dropped: list[str] = field(default_factory=list)
    """'where: why' for each row left out."""


def transcript_messages(row: dict[str, Any], where: str, field_name: str = "messages") -> list[dict[str, str]]:
    """The row's messages, checked: roles system/user/assistant, string contents, exactly one assistant
    message and it comes last, at least one user message before it."""
    messages = _field(row, field_name, where)
    if not isinstance(messages, list):
        raise DataError(f"{where}: field {field_name!r} must be a list of messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        name = f"{field_name}[{i}]"
        if not isinstance(message, dict) or set(message) < {"role", "content"}:
            raise DataError(f"{where}: {name} must be an object with 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ("system", "user", "assistant"):
            raise DataError(f"{where}: {name}.role must be one of system, user, assistant; got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: {name}.content must be a string, got {type(message['content']).__name__}")
    roles = [m["role"] for m in messages]
    if roles.count("assistant") != 1 or roles[-1] != "assistant" or "user" not in roles:
        raise DataError(
            f"{where}: field {field_name!r} must be [system], user, assistant with one assistant message last; "
            f"got roles {roles}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def tokenize_transcript(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a transcript whose last message is the assistant's.

    The prompt is rendered from the messages before it (chat template, generation prompt added) and
    masked out; the assistant text is split into model and observation segments, each tokenized on
    its own; EOS ends the sequence and is trained on, so the model learns to stop.
    """
    ids = protocol.encode_prompt(tokenizer, messages[:-1])
    mask = [0] * len(ids)
    for segment in protocol.split_transcript(messages[-1]["content"]):
        segment_ids = protocol.encode_segment(tokenizer, segment.text)
        ids += segment_ids
        mask += [int(segment.kind == "model")] * len(segment_ids)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids, mask


def load_sft(
    path: str | Path,
    tokenizer: Any,
    *,
    max_tokens: int,
    truncation: Truncation = "right",
    messages_field: str = "messages",
) -> tuple[list[SFTExample], SFTReport]:
    """SFT examples from a ReTool-SFT style file (rows with `messages`), jsonl, json array or parquet.

    Sequences longer than `max_tokens`: `right` keeps the first max_tokens ids (the end of the
    transcript is not trained on), `drop` leaves the row out, `error` raises. A row whose prompt
    alone leaves no room for a trained token is left out under `right` and `drop`. Every row left
    out or cut is counted in the report with its location.
    """
    if truncation not in ("right", "drop", "error"):
        raise ValueError(f"truncation must be one of right, drop, error; got {truncation!r}")
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; SFT sequences end with one")
    examples, report = [], SFTReport()
    for where, row in read_records(path):
        report.rows += 1
        default_id = f"{Path(path).stem}-{report.rows - 1}"
        example, why = sft_example(tokenizer, row, where, max_tokens, truncation, messages_field, default_id)
        if example is None:
            report.dropped.append(why)
            continue
        report.truncated += example.truncated
        examples.append(example)
    return examples, report


def sft_example(
    tokenizer: Any,
    row: dict[str, Any],
    where: str,
    max_tokens: int,
    truncation: Truncation,
    messages_field: str = "messages",
    default_id: str | None = None,
) -> tuple[SFTExample | None, str | None]:
    """One row as an SFT example by load_sft's rules, or (None, why it was left out); DataError names `where`."""
    messages = transcript_messages(row, where, messages_field)
    try:
        ids, mask = tokenize_transcript(tokenizer, messages)
    except ValueError as exc:  # unbalanced interpreter tags
        raise DataError(f"{where}: field {messages_field!r}: assistant content: {exc}") from None
    cut = len(ids) > max_tokens
    if cut:
        why = f"{len(ids)} tokens > max_tokens={max_tokens}"
        if truncation == "error":
            raise DataError(f"{where}: {why} (truncation='error')")
        if truncation == "drop" or sum(mask[:max_tokens]) == 0:
            return None, f"{where}: {why}" + ("" if truncation == "drop" else ", prompt fills it")
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return SFTExample(_id(row, "id", default_id or where), ids, mask, where, cut), None


def write_records(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write records as .jsonl (one JSON object per line) or .parquet, by the file's suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise DataError(f"cannot write {path}: the file name must end in .jsonl or .parquet")
    return path
