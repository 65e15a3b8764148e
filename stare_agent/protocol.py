"""The ReTool text protocol, defined once and used by SFT, RL and evaluation (DESIGN section 4).

A turn of the model may end with a tool call::

    <code>
    ```python
    print(2**100 % 7)
    ```
    </code>

Generation stops at `</code>`; the code runs in the sandbox and `observation(output)` is appended:
`\\n<interpreter>\\n{output}\\n</interpreter>\\n`. The model then continues until it writes its final
answer as `<answer>\\n\\boxed{...}\\n</answer>` (generation also stops at `</answer>`).

Token exactness: sequences are concatenations of separately tokenized segments (the prompt, each
model segment, each observation), never a re-tokenization of the whole text; `encode_segment` is
the one way a segment becomes ids.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Any, Literal

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INTERPRETER_OPEN, INTERPRETER_CLOSE = "<interpreter>", "</interpreter>"
STOP_STRINGS = (CODE_CLOSE, ANSWER_CLOSE)
"""Generation of a turn stops after either string (kept in the output) or at EOS."""

SYSTEM_PROMPT = (
    "You solve math problems with the help of a Python interpreter. Think step by step. Whenever a "
    "calculation, a search or a check is easier in code, write a Python program like this:\n"
    "<code>\n```python\nprint(3**20 % 7)\n```\n</code>\n"
    "It is run at once and what it prints comes back to you between <interpreter> and </interpreter>. "
    "Variables and imports persist from one program to the next, and print() shows results. "
    "When you are sure, give the final answer like this:\n"
    "<answer>\n\\boxed{42}\n</answer>"
)

TRUNCATION_MARKER = "\n... [{omitted} characters omitted] ...\n"


def prompt_messages(problem: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages of the prompt: the protocol's system prompt (unless None) and the problem as the user."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": problem}]


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text, ending where the assistant's reply begins.

    Through the tokenizer's chat template when it has one; otherwise a plain "Role: text" layout, so a
    base model without a template still sees a well-delimited prompt.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*parts, "Assistant: "])


def encode_segment(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one segment on its own: no BOS/EOS added (a chat template writes its own)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return encode_segment(tokenizer, render_prompt(tokenizer, messages))


# --- reading a model turn -----------------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def parse_tool_call(turn: str) -> str | None:
    """The code of the tool call that ends this turn, or None when the turn makes no call.

    A turn calls the tool when it contains `</code>` and no `<code>` or `<answer>` follows the last
    `</code>` (text after it can only be the rest of the token that held the stop string). The call's
    code is the last block, chosen as follows (documented tolerance for imperfect models):
    - the block is the text between the last `<code>` before that `</code>` and the `</code>`;
    - inside it, the last ```python / ```py / ``` fence wins; a fence that is never closed runs to
      the end of the block; text outside the fences is ignored;
    - a block without fences is taken as code as it is;
    - without an opening `<code>`, the last fenced block before `</code>` is the code; without either,
      the turn is not a call (None);
    - the code is dedented and stripped; an empty block is a call with empty code.
    Several blocks in one turn: only the last runs (generation normally stops at the first `</code>`).
    """
    end = turn.rfind(CODE_CLOSE)
    if end < 0:
        return None
    tail = turn[end + len(CODE_CLOSE) :]
    if CODE_OPEN in tail or ANSWER_OPEN in tail:
        return None
    head = turn[:end]
    start = head.rfind(CODE_OPEN)
    if start >= 0:
        block = head[start + len(CODE_OPEN) :]
    else:
        fence = head.rfind("```")
        if fence < 0:
            return None
        # the closing fence of the block is the last one; its opening fence is the one before it
        opening = head.rfind("```", 0, fence) if head[fence:].strip() == "```" else fence
        if opening < 0:
            return None
        block = head[opening:]
    fences = _FENCE.findall(block)
    code = fences[-1] if fences else block
    return textwrap.dedent(code).strip("\n").rstrip()


# --- what each token of an episode is ---------------------------------------------------------------------------

TOKEN_CLASSES = ("prompt", "reasoning", "code", "tool_output", "answer")
"""The class of each token of an episode (token_classes): the index into this tuple."""
PROMPT, REASONING, CODE, TOOL_OUTPUT, ANSWER = range(len(TOKEN_CLASSES))
AFTER_TOOL_TOKENS = 8
"""How many sampled tokens after an interpreter output count as 'the first tokens after a tool call' in the
per-class entropy metrics (entropy/after_tool)."""

_CLASS_SPANS = (
    (CODE, re.compile(re.escape(CODE_OPEN) + ".*?(?:" + re.escape(CODE_CLOSE) + r"|\Z)", re.DOTALL)),
    (ANSWER, re.compile(re.escape(ANSWER_OPEN) + ".*?(?:" + re.escape(ANSWER_CLOSE) + r"|\Z)", re.DOTALL)),
)


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _token_holding(tokenizer: Any, ids: list[int], char: int) -> int:
    """The index of the token whose text holds character `char` of decode(ids): the first prefix whose decoded
    text is longer than `char` (a binary search: O(log n) decodes)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_decoded(tokenizer, ids[: mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def segment_classes(tokenizer: Any, ids: list[int]) -> list[int]:
    """The class of each token of one model segment: CODE from the token holding `<code>` to the one holding
    `</code>` (or the segment's end), ANSWER likewise for `<answer>`, REASONING for the rest. A token that holds
    part of a tag belongs to the tag's span."""
    text = _decoded(tokenizer, ids)
    out = [REASONING] * len(ids)
    for cls, pattern in _CLASS_SPANS:
        for match in pattern.finditer(text):
            first = _token_holding(tokenizer, ids, match.start())
            last = _token_holding(tokenizer, ids, max(match.end() - 1, match.start()))
            out[first : last + 1] = [cls] * (last + 1 - first)
    return out


def token_classes(tokenizer: Any, token_ids: list[int], action_mask: list[int]) -> list[int]:
    """The class (TOKEN_CLASSES index) of every token of an episode, from its ids and action mask (1 = sampled):
    PROMPT before the first sampled token, TOOL_OUTPUT for every later token the policy did not sample, and for
    each run of sampled tokens (one model segment) segment_classes of its ids."""
    if len(token_ids) != len(action_mask):
        raise ValueError(f"token_ids and action_mask differ in length: {len(token_ids)} != {len(action_mask)}")
    out: list[int] = []
    start, n = 0, len(token_ids)
    while start < n:
        end = start
        while end < n and bool(action_mask[end]) == bool(action_mask[start]):
            end += 1
        if action_mask[start]:
            out += segment_classes(tokenizer, list(token_ids[start:end]))
        else:
            out += [TOOL_OUTPUT if start > 0 else PROMPT] * (end - start)  # runs alternate: after the prompt,
            # every unsampled run follows a model segment
        start = end
    return out


def is_void_turn(text: str) -> bool:
    """A model turn with neither a code block nor an answer (no `<code>`, `</code>`, `<answer>` or `\\boxed{`)."""
    return not any(mark in text for mark in (CODE_OPEN, CODE_CLOSE, ANSWER_OPEN, "\\boxed{"))


# --- tool output --------------------------------------------------------------------------------------------------


def truncate(text: str, max_chars: int) -> str:
    """At most `max_chars` characters of `text` kept: head and tail halves around a marker saying how many
    characters were cut. Shorter text is returned unchanged."""
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0; got {max_chars}")
    if len(text) <= max_chars:
        return text
    head = (max_chars + 1) // 2
    tail = max_chars - head
    marker = TRUNCATION_MARKER.format(omitted=len(text) - max_chars)
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def tool_output(result: Any, max_chars: int) -> str:
    """What the model sees of a sandbox RunResult: stdout, then on failure the error's last traceback line
    (`ZeroDivisionError: division by zero`) or the timeout message; cut to `max_chars` (head + tail).

    Surrounding newlines are stripped so the observation's own newlines frame the output. A
    `sandbox_error` never reaches the model (the agent retries or gives up); it is not rendered here.
    """
    if result.status == "sandbox_error":
        raise ValueError("a sandbox_error result is an infrastructure failure and is not shown to the model")
    text = result.stdout.strip("\n")
    if result.status != "ok":
        error = result.error
        line = f"{error.name}: {error.message}" if error is not None else result.status
        if result.status == "timeout":
            line = f"TimeoutError: {error.message}" if error is not None else "TimeoutError: execution timed out"
        text = f"{text}\n{line}" if text else line
    return truncate(text, max_chars)


def observation(output: str) -> str:
    """The one rendering of tool output appended after a call, in SFT and RL alike."""
    return f"\n{INTERPRETER_OPEN}\n{output}\n{INTERPRETER_CLOSE}\n"


def final_answer(answer: str) -> str:
    """The protocol's final-answer block."""
    return f"{ANSWER_OPEN}\n\\boxed{{{answer}}}\n{ANSWER_CLOSE}"


# --- transcripts (SFT) --------------------------------------------------------------------------------------------

Kind = Literal["model", "observation"]


@dataclass(frozen=True)
class Segment:
    kind: Kind
    """model: text the policy writes (trained on); observation: interpreter output (never trained on)."""
    text: str


_INTERPRETER_BLOCK = re.compile(r"\n?<interpreter>\n?(.*?)\n?</interpreter>\n?", re.DOTALL)


def split_transcript(text: str) -> list[Segment]:
    """An assistant transcript cut into model and observation segments, observations re-rendered by
    `observation()` so SFT trains on exactly the bytes RL shows the model.

    One newline on each side of an `<interpreter>` block belongs to the observation (as `observation()`
    writes it); any further whitespace stays in the neighbouring model segment. Raises ValueError on an
    unclosed or stray interpreter tag.
    """
    segments: list[Segment] = []
    position = 0
    for match in _INTERPRETER_BLOCK.finditer(text):
        before = text[position : match.start()]
        if INTERPRETER_OPEN in before or INTERPRETER_CLOSE in before:
            raise ValueError(f"unbalanced {INTERPRETER_OPEN} tag before character {match.start()}")
        if before:
            segments.append(Segment("model", before))
        segments.append(Segment("observation", observation(match.group(1))))
        position = match.end()
    rest = text[position:]
    if INTERPRETER_OPEN in rest or INTERPRETER_CLOSE in rest:
        raise ValueError(f"unclosed or stray {INTERPRETER_OPEN} tag after character {position}")
    if rest:
        segments.append(Segment("model", rest))
    return segments
