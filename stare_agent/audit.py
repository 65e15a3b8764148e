"""The mask audit (`rollout.audit_masks`): each trained sample's action mask checked against its own ids.

Both backends train on a sequence of ids with an action mask shifted by one (position t predicts id t + 1: the
mask and the rollout log-probs have one entry fewer than the ids) and, in OpenRLHF, cut at its max_len. The audit
takes exactly that, as the trainer received it, and rebuilds what the mask must be from the ids alone:

- the sequence starts with the prompt's ids as protocol.encode_prompt makes them from the problem text, and no
  prompt id is an action (so a sample's prompt is the one SFT and evaluation use);
- after the prompt, runs of sampled ids (model turns) alternate with runs of unsampled ids, and every unsampled run
  decodes to exactly one interpreter block as protocol.observation renders it, after a turn that calls the tool
  (an observation only ever follows a call); a sequence cut short may end inside one;
- the rollout log-prob is 0.0 at every unsampled position and a finite log-probability (<= 0) at every sampled one;
- with the episode's own counts (sampled and observation ids), the mask holds exactly that many of each (at most,
  when the sequence was cut).

A mask that a bug shifted, widened or narrowed by even one id breaks one of these: a sampled id inside an
interpreter block, a block that no longer decodes whole, a prompt id marked as an action. The first violation
raises MaskAuditError naming the sample, the position and the token's text. The checks cost a few decodes per
sample (docs/benchmarks.md measures them against a training step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from stare_agent import protocol

OBSERVATION_OPEN = "\n" + protocol.INTERPRETER_OPEN + "\n"
OBSERVATION_CLOSE = "\n" + protocol.INTERPRETER_CLOSE + "\n"
"""How protocol.observation(output) starts and ends: OBSERVATION_OPEN + output + OBSERVATION_CLOSE."""


class MaskAuditError(ValueError):
    """A trained sample whose action mask disagrees with its ids (rollout.audit_masks)."""


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _runs(mask: Sequence[int], start: int) -> list[tuple[int, int, bool]]:
    """(begin, end, sampled) of each maximal run of equal mask values from `start`."""
    runs, begin = [], start
    for i in range(start + 1, len(mask) + 1):
        if i == len(mask) or bool(mask[i]) != bool(mask[begin]):
            runs.append((begin, i, bool(mask[begin])))
            begin = i
    return runs


def audit_sample(
    tokenizer: Any,
    ids: Sequence[int],
    action_mask: Sequence[int],
    rollout_logprobs: Sequence[float],
    prompt_ids: Sequence[int],
    *,
    where: str,
    sampled_tokens: int | None = None,
    observation_tokens: int | None = None,
    cut: bool = False,
) -> None:
    """Check one sample as the trainer receives it; MaskAuditError at the first violation.

    ids: the n ids trained on; action_mask, rollout_logprobs: n - 1 entries, entry t for id t + 1 (the shifted
    convention of both trainers); prompt_ids: protocol.encode_prompt of the sample's problem; sampled_tokens,
    observation_tokens: the episode's own counts, if known; cut: the sequence was cut to a length limit after
    the episode (it may end inside any segment, and the counts are upper bounds). `where` names the sample.
    """
    n = len(ids)
    if len(action_mask) != n - 1 or len(rollout_logprobs) != n - 1:
        raise MaskAuditError(
            f"{where}: {n} ids but {len(action_mask)} action-mask and {len(rollout_logprobs)} log-prob entries "
            f"(expected {n - 1} each: entry t is for id t + 1)"
        )
    mask = [0, *(int(bool(m)) for m in action_mask)]  # per id
    logprobs = [0.0, *(float(v) for v in rollout_logprobs)]

    def fail(position: int, why: str) -> MaskAuditError:
        token = _decode(tokenizer, [ids[position]]) if 0 <= position < n else ""
        return MaskAuditError(f"{where}: position {position} (token {token!r}, mask {mask[position]}): {why}")

    prompt_len = min(len(prompt_ids), n) if cut else len(prompt_ids)
    if list(ids[:prompt_len]) != list(prompt_ids[:prompt_len]):
        first = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids, strict=False)) if a != b), n)
        raise fail(first, f"the sequence does not start with the problem's prompt ids ({len(prompt_ids)} ids)")
    for i in range(prompt_len):
        if mask[i]:
            raise fail(i, "a prompt id is marked as an action")
    for i in range(n):
        value = logprobs[i]
        if not mask[i] and value != 0.0:
            raise fail(i, f"an unsampled id has rollout log-prob {value} (expected 0.0)")
        if mask[i] and not (math.isfinite(value) and value <= 1e-4):
            raise fail(i, f"a sampled id has rollout log-prob {value} (expected a finite value <= 0)")

    runs = _runs(mask, prompt_len) if prompt_len < n else []
    if runs and not runs[0][2]:
        raise fail(runs[0][0], "the response starts with an unsampled id (it must start with a model turn)")
    for k, (begin, end, sampled) in enumerate(runs):
        if sampled:
            continue
        text = _decode(tokenizer, ids[begin:end])
        whole = text.startswith(OBSERVATION_OPEN) and text.endswith(OBSERVATION_CLOSE)
        opened = text.startswith(OBSERVATION_OPEN) or OBSERVATION_OPEN.startswith(text)
        if not whole and not (cut and end == n and opened):  # a cut sequence may end inside its last block
            raise fail(begin, f"unsampled ids {begin}..{end - 1} decode to {text[:80]!r}, not an interpreter block")
        turn = _decode(tokenizer, ids[runs[k - 1][0] : runs[k - 1][1]])
        if protocol.parse_tool_call(turn) is None:
            raise fail(begin, "an interpreter block follows a model turn that makes no tool call")

    actions = sum(mask)
    unsampled = n - prompt_len - actions
    counts = (("sampled", actions, sampled_tokens), ("observation", unsampled, observation_tokens))
    for name, count, expected in counts:
        if expected is None:
            continue
        if count > expected or (not cut and count != expected):
            raise MaskAuditError(
                f"{where}: the mask has {count} {name} ids but the episode recorded {expected}"
                + (" (the sequence was cut: at most that many)" if cut else "")
            )


def audit_trained(
    tokenizer: Any,
    ids: Sequence[int],
    action_mask: Sequence[int],
    rollout_logprobs: Sequence[float],
    problem: str,
    system_prompt: str | None,
    *,
    where: str,
    sampled_tokens: int | None = None,
    observation_tokens: int | None = None,
    cut: bool = False,
) -> None:
    """audit_sample with the prompt ids made from the problem text as every stage makes them
    (protocol.encode_prompt of protocol.prompt_messages): what both backends call on each trained sample."""
    prompt_ids = protocol.encode_prompt(tokenizer, protocol.prompt_messages(problem, system_prompt))
    audit_sample(
        tokenizer, ids, action_mask, rollout_logprobs, prompt_ids, where=where, sampled_tokens=sampled_tokens,
        observation_tokens=observation_tokens, cut=cut,
    )  # fmt: skip
