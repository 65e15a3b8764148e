"""Benchmark loaders and the generic problem loader: schemas mapped, bad input named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stare_agent import protocol
from stare_agent.data import (
    BENCHMARKS,
    DEFAULT_BENCHMARKS_DIR,
    DataError,
    Problem,
    benchmark_dir,
    load_benchmark,
    load_problems,
    load_sft,
    tokenize_transcript,
    write_records,
)

SIZES = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272, "olympiadbench": 675}
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmarks_ship_with_the_repository(name, monkeypatch):
    # No argument and no environment variable: the files come from the repository's data/benchmarks.
    monkeypatch.delenv("STARE_BENCHMARKS_DIR", raising=False)
    assert benchmark_dir() == DEFAULT_BENCHMARKS_DIR == SHIPPED
    assert (SHIPPED / BENCHMARKS[name][0]).is_file()
    assert len(load_benchmark(name)) == SIZES[name]


def test_benchmark_dir_precedence_argument_then_env_then_shipped(tmp_path, monkeypatch):
    # A small copy (the first three AIME 2024 rows, one of them changed) shows which file was read.
    rows = (SHIPPED / "aime24.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    first = json.loads(rows[0])
    rows[0] = json.dumps({**first, "answer": "12345"})
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    for folder, n in ((env_dir, 3), (arg_dir, 2)):
        folder.mkdir()
        (folder / "aime24.jsonl").write_text("\n".join(rows[:n]) + "\n", encoding="utf-8")

    monkeypatch.setenv("STARE_BENCHMARKS_DIR", str(env_dir))
    assert benchmark_dir() == env_dir
    from_env = load_benchmark("aime24")
    assert len(from_env) == 3 and from_env[0].answer == "12345" and from_env[0].id == str(first["id"])
    assert len(load_benchmark("aime24", arg_dir)) == 2  # the argument beats the variable
    monkeypatch.setenv("STARE_BENCHMARKS_DIR", "")  # empty = unset
    assert benchmark_dir() == SHIPPED and len(load_benchmark("aime24")) == 30


def test_missing_benchmark_folder_or_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("STARE_BENCHMARKS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"benchmark folder .*nowhere \(from \$STARE_BENCHMARKS_DIR\) not found") as e:
        load_benchmark("math500")
    assert "data_dir" in str(e.value) and "data/benchmarks" in str(e.value)
    with pytest.raises(DataError, match=r"benchmark file .*math500\.json \(from the data_dir argument\) not found"):
        load_benchmark("math500", tmp_path)


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


# --- SFT transcripts ----------------------------------------------------------------------------------------------

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "retool_sft" / "sample.jsonl"
TRANSCRIPT = (
    "Let me compute.\n<code>\n```python\nprint(6 * 7)\n```\n</code>\n<interpreter>\n42\n</interpreter>\n"
    "The program prints 42.\n<answer>\n\\boxed{42}\n</answer>"
)


def _row(content=TRANSCRIPT, **extra):
    return {
        "messages": [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": content}],
        **extra,
    }


def test_transcript_masks_align_with_the_segments(tiny_tokenizer):
    messages = _row()["messages"]
    ids, mask = tokenize_transcript(tiny_tokenizer, messages)
    prompt = protocol.encode_prompt(tiny_tokenizer, messages[:1])
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    # reading the ids back segment by segment gives the text of each segment, masked as its kind
    position = len(prompt)
    for segment in protocol.split_transcript(TRANSCRIPT):
        n = len(protocol.encode_segment(tiny_tokenizer, segment.text))
        assert tiny_tokenizer.decode(ids[position : position + n]) == segment.text
        assert set(mask[position : position + n]) == {int(segment.kind == "model")}
        position += n
    assert ids[position:] == [tiny_tokenizer.eos_token_id] and mask[position:] == [1]
    trained = tiny_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
    assert "<interpreter>" not in trained and "42\n</interpreter>" not in trained


def test_sft_ids_equal_the_rl_episode_ids(tiny_tokenizer):
    """A transcript of an episode tokenizes to the episode's own ids (plus the trained EOS)."""
    import asyncio

    from stare_agent.agent import AgentConfig, Sample, run_episode
    from stare_sandbox.inprocess import InProcessClient

    turns = [TRANSCRIPT[: TRANSCRIPT.index("</code>") + 7], TRANSCRIPT[TRANSCRIPT.index("The program") :]]

    async def generate(ids, max_new_tokens):
        return Sample(*(lambda t: (t, [0.0] * len(t)))(protocol.encode_segment(tiny_tokenizer, turns.pop(0))), "stop")

    async def episode():
        async with InProcessClient() as client:
            problem = Problem(id="x", problem="What is 6*7?", answer="42", source="t")
            return await run_episode(
                problem,
                tokenizer=tiny_tokenizer,
                generate=generate,
                client=client,
                config=AgentConfig(system_prompt=None),
            )

    result = asyncio.run(episode())
    assert result.reward == 1.0
    ids, mask = tokenize_transcript(tiny_tokenizer, _row()["messages"])
    assert ids == result.token_ids + [tiny_tokenizer.eos_token_id]
    assert mask == result.action_mask + [1]
    # the same tokens are left out of both: the prompt, and the interpreter block with its tags
    prompt = protocol.encode_prompt(tiny_tokenizer, _row()["messages"][:1])
    assert not any(result.action_mask[: len(prompt)])
    sampled = tiny_tokenizer.decode([t for t, m in zip(result.token_ids, result.action_mask, strict=True) if m])
    assert "<interpreter>" not in sampled and "</interpreter>" not in sampled and "42\n" not in sampled
    assert sampled.replace("</code>", "</code>\n<interpreter>\n42\n</interpreter>\n") == TRANSCRIPT


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_load_sft_from_each_format(tiny_tokenizer, tmp_path, suffix):
    rows = [_row(id="a"), _row(content="Just <answer>\n\\boxed{42}\n</answer>")]
    path = tmp_path / f"sft{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        write_records(path, rows)
    examples, report = load_sft(path, tiny_tokenizer, max_tokens=4096)
    assert [e.id for e in examples] == ["a", "sft-1"] and report.rows == 2 and not report.dropped
    assert examples[0].input_ids == tokenize_transcript(tiny_tokenizer, rows[0]["messages"])[0]
    assert examples[0].where.startswith(str(path))


def test_the_shipped_sample_set_loads(tiny_tokenizer):
    examples, report = load_sft(SAMPLE, tiny_tokenizer, max_tokens=4096)
    assert len(examples) == 64 and report.truncated == 0 and not report.dropped
    assert all(sum(e.loss_mask) > 0 and len(e.input_ids) == len(e.loss_mask) for e in examples)


def test_truncation_policies(tiny_tokenizer, tmp_path):
    path = write_records(tmp_path / "long.jsonl", [_row(), _row(content="short <answer>\\boxed{42}</answer>")])
    full = len(tokenize_transcript(tiny_tokenizer, _row()["messages"])[0])
    prompt = len(protocol.encode_prompt(tiny_tokenizer, _row()["messages"][:1]))
    limit = full - 5
    examples, report = load_sft(path, tiny_tokenizer, max_tokens=limit)
    assert report.truncated == 1 and examples[0].truncated and len(examples[0].input_ids) == limit
    examples, report = load_sft(path, tiny_tokenizer, max_tokens=limit, truncation="drop")
    assert len(examples) == 1 and report.dropped == [f"{path}:1: {full} tokens > max_tokens={limit}"]
    with pytest.raises(DataError, match=r"long\.jsonl:1: .* tokens > max_tokens"):
        load_sft(path, tiny_tokenizer, max_tokens=limit, truncation="error")
    # a prompt that fills the budget leaves nothing to train on: left out, and counted
    examples, report = load_sft(path, tiny_tokenizer, max_tokens=prompt)
    assert examples == [] and len(report.dropped) == 2 and "prompt fills it" in report.dropped[0]
    with pytest.raises(ValueError, match="truncation must be one of right, drop, error"):
        load_sft(path, tiny_tokenizer, max_tokens=10, truncation="left")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "x"}, r"bad\.jsonl:1: missing field 'messages'"),
        ({"messages": "hi"}, r"field 'messages' must be a list"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object with 'role' and 'content'"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            r"messages\[0\]\.role must be one of system, user, assistant",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content must be a string"),
        ({"messages": [{"role": "user", "content": "q"}]}, r"one assistant message last; got roles \['user'\]"),
        (_row(content="a <interpreter>\n1\n"), r"bad\.jsonl:1: field 'messages': assistant content: unclosed"),
    ],
)
def test_bad_sft_rows_are_named(tiny_tokenizer, tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_sft(path, tiny_tokenizer, max_tokens=100)


def test_parquet_rows_are_named_in_errors(tmp_path):
    path = write_records(
        tmp_path / "set.parquet", [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": None}]
    )
    with pytest.raises(DataError, match=r"set\.parquet: row 1: missing field 'answer'"):
        load_problems(path)
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(DataError, match=r"cannot read .*fake\.parquet as parquet"):
        load_problems(not_parquet)
    with pytest.raises(DataError, match=r"must end in \.jsonl or \.parquet"):
        write_records(tmp_path / "x.csv", [])
