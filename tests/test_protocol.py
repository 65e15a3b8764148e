"""The ReTool text protocol: code-block parsing, tool output, observations, transcripts, prompts."""

from __future__ import annotations

import pytest

from stare_agent import protocol
from stare_agent.protocol import Segment, observation, parse_tool_call, split_transcript, tool_output, truncate
from stare_sandbox.schemas import ErrorInfo, RunResult

FENCED = "<code>\n```python\nx = 2**10\nprint(x)\n```\n</code>"


@pytest.mark.parametrize(
    ("turn", "code"),
    [
        (f"Let me compute.\n{FENCED}", "x = 2**10\nprint(x)"),
        # the stop string ended inside a token: the rest of that token follows </code>
        (f"{FENCED}\n\n", "x = 2**10\nprint(x)"),
        ("<code>\n```py\nprint(1)\n```\n</code>", "print(1)"),
        ("<code>\n```\nprint(1)\n```\n</code>", "print(1)"),
        ("<code>\n```Python\nprint(1)\n```\n</code>", "print(1)"),
        # missing fences: the block is the code
        ("<code>\nprint(1)\n</code>", "print(1)"),
        # a fence never closed runs to the end of the block
        ("<code>\n```python\nprint(1)\n</code>", "print(1)"),
        # text around the fence inside the block is ignored
        ("<code>\nHere it is:\n```python\nprint(1)\n```\ndone\n</code>", "print(1)"),
        # several blocks: the last one runs
        ("<code>\n```python\nprint(1)\n```\n</code> and <code>\n```python\nprint(2)\n```\n</code>", "print(2)"),
        ("<code>\n```python\nprint(1)\n```\n```python\nprint(3)\n```\n</code>", "print(3)"),
        # no opening tag: the last fenced block before </code>
        ("Compute:\n```python\nprint(4)\n```\n</code>", "print(4)"),
        ("Compute:\n```python\nprint(5)\n</code>", "print(5)"),
        # indentation of the whole block is removed, inner indentation kept
        (
            "<code>\n```python\n    for i in range(2):\n        print(i)\n```\n</code>",
            "for i in range(2):\n    print(i)",
        ),
        ("<code>\n```python\n```\n</code>", ""),
    ],
)
def test_parse_tool_call(turn, code):
    assert parse_tool_call(turn) == code


@pytest.mark.parametrize(
    "turn",
    [
        "No tool here. <answer>\n\\boxed{3}\n</answer>",
        "Unclosed <code>\n```python\nprint(1)\n```\n",  # cut by length: not a call
        f"{FENCED}\nso the answer is <answer>\\boxed{{1024}}</answer>",  # answered after the block
        "a stray </code> without any code",
        "",
    ],
)
def test_turns_without_a_call(turn):
    assert parse_tool_call(turn) is None


def test_truncate_keeps_head_and_tail_within_budget():
    text = "".join(f"{i:04d}\n" for i in range(2000))
    cut = truncate(text, 100)
    assert cut.startswith(text[:50]) and cut.endswith(text[-50:])
    assert f"[{len(text) - 100} characters omitted]" in cut
    assert len(cut) - len(protocol.TRUNCATION_MARKER.format(omitted=len(text) - 100)) == 100
    assert truncate("short", 100) == "short"
    assert truncate("abcdef", 1) == "a" + protocol.TRUNCATION_MARKER.format(omitted=5)
    with pytest.raises(ValueError, match="max_chars"):
        truncate("x", -1)


def _result(status, stdout="", error=None):
    return RunResult(status=status, stdout=stdout, error=error, duration_ms=1.0)


def test_tool_output():
    assert tool_output(_result("ok", "1024\n"), 100) == "1024"
    error = ErrorInfo(name="ZeroDivisionError", message="division by zero", traceback="Traceback ...\n...")
    assert tool_output(_result("error", "partial\n", error), 100) == "partial\nZeroDivisionError: division by zero"
    assert tool_output(_result("error", "", error), 100) == "ZeroDivisionError: division by zero"
    timeout = ErrorInfo(name="Timeout", message="execution exceeded 10 s")
    assert tool_output(_result("timeout", "", timeout), 100) == "TimeoutError: execution exceeded 10 s"
    memory = ErrorInfo(name="MemoryError", message="")
    assert tool_output(_result("memory", "", memory), 100) == "MemoryError: "
    assert len(tool_output(_result("ok", "9" * 10_000), 200)) < 260
    with pytest.raises(ValueError, match="infrastructure"):
        tool_output(_result("sandbox_error", "", ErrorInfo(name="KernelDied", message="")), 100)


def test_observation_format():
    assert observation("42") == "\n<interpreter>\n42\n</interpreter>\n"


def test_split_transcript_renders_observations_with_the_one_function():
    text = (
        "Compute it.\n<code>\n```python\nprint(6*7)\n```\n</code>\n<interpreter>\n42\n</interpreter>\n"
        "So <answer>\n\\boxed{42}\n</answer>"
    )
    segments = split_transcript(text)
    assert segments == [
        Segment("model", "Compute it.\n<code>\n```python\nprint(6*7)\n```\n</code>"),
        Segment("observation", observation("42")),
        Segment("model", "So <answer>\n\\boxed{42}\n</answer>"),
    ]
    assert "".join(s.text for s in segments) == text


def test_split_transcript_normalises_spacing_and_keeps_extra_whitespace_in_model_text():
    text = "A</code><interpreter>7</interpreter>\n\nB"
    segments = split_transcript(text)
    assert segments == [
        Segment("model", "A</code>"),
        Segment("observation", observation("7")),
        Segment("model", "\nB"),
    ]
    # several interpreter blocks, multi-line output
    text = "x</code>\n<interpreter>\n1\n2\n</interpreter>\ny</code>\n<interpreter>\n\n</interpreter>\n"
    assert [s.kind for s in split_transcript(text)] == ["model", "observation", "model", "observation"]
    assert split_transcript(text)[1].text == observation("1\n2")


@pytest.mark.parametrize(
    "text", ["a <interpreter>\n1\n", "a </interpreter> b", "<interpreter>1</interpreter> <interpreter>"]
)
def test_split_transcript_rejects_unbalanced_tags(text):
    with pytest.raises(ValueError, match="interpreter"):
        split_transcript(text)


def test_prompt_without_chat_template_is_plain_and_delimited():
    class Plain:
        chat_template = None

    text = protocol.render_prompt(Plain(), protocol.prompt_messages("What is 1+1?"))
    assert text.startswith("System: You solve math problems") and text.endswith("User: What is 1+1?\n\nAssistant: ")
    assert protocol.prompt_messages("p", None) == [{"role": "user", "content": "p"}]


def test_system_prompt_shows_the_protocol_it_parses():
    example = protocol.SYSTEM_PROMPT[protocol.SYSTEM_PROMPT.index("<code>") :]
    assert parse_tool_call(example[: example.index("</code>") + len("</code>")]) == "print(3**20 % 7)"
    assert protocol.final_answer("42") in protocol.SYSTEM_PROMPT


def test_token_classes_of_an_episode_follow_its_segments_and_tags(tiny_tokenizer):
    """Prompt, a turn with reasoning and a code block, the observation, a turn with reasoning and an answer: every
    token of the code block and of the answer (tags included) is CODE / ANSWER, the rest of a turn REASONING, the
    unsampled ids PROMPT before the first turn and TOOL_OUTPUT after it. (Each piece is encoded alone, so its
    tokens start at its first character.)"""
    pieces = [  # (text, sampled, the class of each of its tokens)
        ("User: what is 2^10?\n\nAssistant: ", 0, protocol.PROMPT),
        ("Let me compute.\n", 1, protocol.REASONING),
        ("<code>\n```python\nprint(2**10)\n```\n</code>", 1, protocol.CODE),
        (observation("1024"), 0, protocol.TOOL_OUTPUT),
        ("So the answer is\n", 1, protocol.REASONING),
        ("<answer>\n\\boxed{1024}\n</answer>", 1, protocol.ANSWER),
    ]
    ids, mask, expected = [], [], []
    for text, sampled, cls in pieces:
        seg = protocol.encode_segment(tiny_tokenizer, text)
        ids, mask, expected = ids + seg, mask + [sampled] * len(seg), expected + [cls] * len(seg)
    classes = protocol.token_classes(tiny_tokenizer, ids, mask)
    assert classes == expected
    assert set(classes) == set(range(len(protocol.TOKEN_CLASSES)))
    with pytest.raises(ValueError, match="differ in length"):
        protocol.token_classes(tiny_tokenizer, ids, mask[:-1])


def test_a_tag_inside_a_merged_token_puts_that_token_in_the_span(tiny_tokenizer):
    """Ids cut so that a tag starts inside a token (the token also holds reasoning text): that token is CODE."""
    text = "x<code>print(1)</code>"
    ids = protocol.encode_segment(tiny_tokenizer, text)
    classes = protocol.segment_classes(tiny_tokenizer, ids)
    decoded = [tiny_tokenizer.decode([i]) for i in ids]
    first_code = next(i for i, c in enumerate(classes) if c == protocol.CODE)
    assert "".join(decoded[:first_code]) + decoded[first_code] >= "x<"  # the token that holds '<' of '<code>'
    assert "<" in decoded[first_code] and classes[-1] == protocol.CODE
    assert all(c == protocol.REASONING for c in classes[:first_code])


def test_void_turns_have_neither_code_nor_an_answer():
    assert protocol.is_void_turn("let me think again")
    assert not protocol.is_void_turn("<code>\nprint(1)\n</code>")
    assert not protocol.is_void_turn("so \\boxed{3}")
    assert not protocol.is_void_turn("<answer>3</answer>")
