"""The mask audit (rollout.audit_masks): a trained sample's action mask against its own ids, on Qwen's tokenizer.

The sample is the golden Qwen episode (tests/forced.py: a call whose stop string ends inside `>ĊĊ`, its
observation, an answer ending inside `>.`) as a trainer receives it: ids, and the mask and log-probs shifted by
one. Each broken variant is a bug the audit exists to stop.
"""

from __future__ import annotations

import pytest
from forced import QWEN_CALL  # tests/forced.py

from stare_agent import protocol
from stare_agent.audit import MaskAuditError, audit_sample, audit_trained

PROBLEM = "What is 7 times 3?"


@pytest.fixture(scope="module")
def sample(qwen_tokenizer, qwen_script):
    s = qwen_script
    prompt = protocol.encode_prompt(qwen_tokenizer, protocol.prompt_messages(PROBLEM))
    ids = prompt + s["call"] + s["observation"] + s["answer"]
    mask = [0] * len(prompt) + [1] * len(s["call"]) + [0] * len(s["observation"]) + [1] * len(s["answer"])
    logprobs = [-0.5 if m else 0.0 for m in mask]
    return {
        "ids": ids, "mask": mask[1:], "logprobs": logprobs[1:], "prompt": prompt, "call": len(prompt) + len(s["call"]),
        "sampled": len(s["call"]) + len(s["answer"]), "observation": len(s["observation"]),
    }  # fmt: skip


def check(tokenizer, sample, **changes):
    args = {
        "ids": sample["ids"], "action_mask": sample["mask"], "rollout_logprobs": sample["logprobs"],
        "sampled_tokens": sample["sampled"], "observation_tokens": sample["observation"], "cut": False, **changes,
    }  # fmt: skip
    audit_sample(
        tokenizer, args.pop("ids"), args.pop("action_mask"), args.pop("rollout_logprobs"), sample["prompt"],
        where="sample 3", **args,
    )  # fmt: skip


def flipped(mask: list[int], position: int) -> list[int]:
    """The shifted mask with the entry of id `position` flipped."""
    out = list(mask)
    out[position - 1] = 1 - out[position - 1]
    return out


def test_the_golden_sample_passes_and_through_the_problem_text(qwen_tokenizer, sample):
    check(qwen_tokenizer, sample)
    audit_trained(
        qwen_tokenizer, sample["ids"], sample["mask"], sample["logprobs"], PROBLEM, protocol.SYSTEM_PROMPT,
        where="x", sampled_tokens=sample["sampled"], observation_tokens=sample["observation"],
    )  # fmt: skip


def test_an_unshifted_mask_is_caught(qwen_tokenizer, sample):
    unshifted = [0] * (len(sample["ids"]) - len(sample["mask"]) - 1) + [0, *sample["mask"][:-1]]
    with pytest.raises(MaskAuditError, match=r"sample 3: position \d+ \(token '.*', mask \d\)"):
        check(qwen_tokenizer, sample, action_mask=unshifted)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("last call id", "decode to '>\\\\n\\\\n\\\\n<interpreter>"),  # `>ĊĊ` taken into the observation
        ("first observation id", "decode to '<interpreter>"),  # the observation's newline marked as sampled
        ("a prompt id", "a prompt id is marked as an action"),
        ("first answer id", "decode to '\\\\n<interpreter>\\\\n21\\\\n</interpreter>\\\\n\\\\\\\\'"),
    ],
)
def test_one_flipped_id_is_caught_with_its_position_and_token(qwen_tokenizer, sample, where, message):
    position = {
        "last call id": sample["call"] - 1,
        "first observation id": sample["call"],
        "a prompt id": 5,
        "first answer id": sample["call"] + sample["observation"],
    }[where]
    mask = flipped(sample["mask"], position)  # log-probs that agree with it: the structure alone must catch it
    with pytest.raises(MaskAuditError, match=rf"position \d+ .*{message}"):
        check(qwen_tokenizer, sample, action_mask=mask, rollout_logprobs=[-0.5 if m else 0.0 for m in mask])
    with pytest.raises(MaskAuditError, match=r"sample 3: position \d+"):  # with the log-probs as sampled too
        check(qwen_tokenizer, sample, action_mask=mask)


def test_a_prompt_not_the_problems_is_caught(qwen_tokenizer, sample):
    with pytest.raises(MaskAuditError, match="does not start with the problem's prompt ids"):
        audit_trained(
            qwen_tokenizer, sample["ids"], sample["mask"], sample["logprobs"], PROBLEM, None, where="x"
        )  # the episode was made with the protocol's system prompt


def test_log_probs_lengths_and_counts(qwen_tokenizer, sample):
    logprobs = list(sample["logprobs"])
    logprobs[sample["call"]] = -0.1  # an observation id (shifted index call - 1 + 1)
    with pytest.raises(MaskAuditError, match="an unsampled id has rollout log-prob -0.1"):
        check(qwen_tokenizer, sample, rollout_logprobs=logprobs)
    logprobs = list(sample["logprobs"])
    logprobs[-1] = float("nan")
    with pytest.raises(MaskAuditError, match="a sampled id has rollout log-prob nan"):
        check(qwen_tokenizer, sample, rollout_logprobs=logprobs)
    with pytest.raises(MaskAuditError, match="entry t is for id t \\+ 1"):
        check(qwen_tokenizer, sample, action_mask=[0, *sample["mask"]])
    recorded = sample["sampled"]
    with pytest.raises(
        MaskAuditError, match=f"the mask has {recorded} sampled ids but the episode recorded {recorded + 1}"
    ):
        check(qwen_tokenizer, sample, sampled_tokens=sample["sampled"] + 1)


def test_a_cut_sequence_may_end_inside_a_block_only_when_cut(qwen_tokenizer, sample):
    end = sample["call"] + 3  # inside the observation
    cut = {
        "ids": sample["ids"][:end],
        "action_mask": sample["mask"][: end - 1],
        "rollout_logprobs": sample["logprobs"][: end - 1],
    }
    check(qwen_tokenizer, sample, cut=True, **cut)
    with pytest.raises(MaskAuditError, match="not an interpreter block"):
        check(qwen_tokenizer, sample, **cut)


def test_an_observation_after_a_turn_without_a_call_is_caught(qwen_tokenizer, sample):
    text_turn = protocol.encode_segment(qwen_tokenizer, "I think it is 21.")
    observation = protocol.encode_segment(qwen_tokenizer, protocol.observation("21"))
    ids = sample["prompt"] + text_turn + observation
    mask = [0] * len(sample["prompt"]) + [1] * len(text_turn) + [0] * len(observation)
    with pytest.raises(MaskAuditError, match="follows a model turn that makes no tool call"):
        audit_sample(qwen_tokenizer, ids, mask[1:], [-0.1 * m for m in mask[1:]], sample["prompt"], where="x")
    assert protocol.parse_tool_call(QWEN_CALL) == "print(7*3)"
