"""The local batched sampler against slow, obvious versions on the tiny random Qwen2 model.

The references run the full forward over each unpadded sequence, without a cache, so they check the left
padding, the position ids, the KV cache and the removal of finished rows all at once. Finish reasons are
checked on a wrapped model whose logits force known id sequences.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from forced import chains_to_successors  # tests/forced.py
from transformers import AutoModelForCausalLM

from stare_agent.backends.local.generation import HFGenerator, nucleus_filter
from stare_agent.protocol import CODE_CLOSE, encode_segment

TEXTS = [
    "What is 3 plus 4?",
    "Let me check with code.\n<code>\nx = 5\ny = 7\nprint(x * y)\n</code>",
    "a",
    "The sum of the first 12 positive integers is",
    "A store sells apples for 3 dollars each.",
]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    ids = [encode_segment(tiny_tokenizer, text) for text in TEXTS]
    assert len({len(p) for p in ids}) == len(ids), "prompts of different lengths, so left padding matters"
    return ids


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """(T, V) logits of one unpadded sequence, no cache."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def sampled_logits(model, prompt: list[int], sample) -> torch.Tensor:
    """(N, V): the full-forward logits from which each of the N sampled ids was drawn."""
    logits = full_logits(model, prompt + sample.token_ids)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(sample.token_ids)]


class ForcedLM(torch.nn.Module):
    """The model, except that a row whose newest id is a key of `successors` is forced to emit its value."""

    def __init__(self, model, successors: dict[int, int]):
        super().__init__()
        self.model = model
        self.config = model.config
        self.successors = successors

    def forward(self, input_ids, cache=None, **kwargs):
        logits = self.model(input_ids=input_ids, cache=cache, **kwargs).logits.clone()
        for row, last in enumerate(input_ids[:, -1].tolist()):
            if last in self.successors:
                logits[row, -1] = -1e4
                logits[row, -1, self.successors[last]] = 0.0
        return SimpleNamespace(logits=logits)


def single_id(tokenizer, text: str) -> int:
    (token,) = encode_segment(tokenizer, text)
    return token


# --- correctness against full forwards ----------------------------------------------------------------------------


def test_greedy_batch_equals_unbatched_loop_without_cache(model, tiny_tokenizer, prompts):
    budgets = [12, 7, 15, 3, 9]  # rows leave the batch at different steps
    samples = HFGenerator(model, tiny_tokenizer, temperature=0, stop_strings=())(prompts, budgets)
    eos = tiny_tokenizer.eos_token_id
    for prompt, budget, sample in zip(prompts, budgets, samples, strict=True):
        ids, expected, expected_logprobs = list(prompt), [], []
        while len(expected) < budget and eos not in expected:
            logits = full_logits(model, ids)[-1]
            token = int(logits.argmax())
            expected.append(token)
            expected_logprobs.append(float(logits.log_softmax(-1)[token]))
            ids.append(token)
        assert sample.token_ids == expected
        assert sample.finish_reason == ("eos" if expected[-1] == eos else "length")
        torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)


def test_sampled_logprobs_equal_full_forward_log_softmax(model, tiny_tokenizer, prompts):
    budgets = [20, 11, 25, 6, 16]
    samples = HFGenerator(model, tiny_tokenizer, temperature=1.0, top_p=1.0, seed=0)(prompts, budgets)
    for prompt, sample in zip(prompts, samples, strict=True):
        logp = sampled_logits(model, prompt, sample).log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_top_p_samples_inside_the_nucleus_with_renormalised_logprobs(model, tiny_tokenizer, prompts):
    temperature, top_p = 0.7, 0.2
    generator = HFGenerator(model, tiny_tokenizer, temperature=temperature, top_p=top_p, stop_strings=(), seed=3)
    samples = generator(prompts, [30] * len(prompts))
    nucleus_sizes = []
    for prompt, sample in zip(prompts, samples, strict=True):
        probs = (sampled_logits(model, prompt, sample) / temperature).softmax(-1)
        for token, logprob, row in zip(sample.token_ids, sample.logprobs, probs, strict=True):
            nucleus, mass = [], 0.0
            for candidate in row.argsort(descending=True).tolist():  # most probable first, until top_p is reached
                nucleus.append(candidate)
                mass += float(row[candidate])
                if mass >= top_p:
                    break
            assert token in nucleus
            assert logprob == pytest.approx(math.log(float(row[token]) / mass), abs=1e-4)
            nucleus_sizes.append(len(nucleus))
    assert all(1 < size < probs.shape[-1] // 2 for size in nucleus_sizes)  # neither greedy nor unfiltered


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, [0]), (0.55, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2])])
def test_nucleus_filter_keeps_the_token_that_crosses_top_p(top_p, kept):
    logits = torch.tensor([[0.3, 0.5, 0.2]]).log()
    order = [1, 0, 2]  # ids from most to least probable
    filtered = nucleus_filter(logits, top_p)
    expected = torch.full_like(logits, float("-inf"))
    for rank in kept:
        expected[0, order[rank]] = logits[0, order[rank]]
    assert torch.equal(filtered, expected)


# --- randomness ---------------------------------------------------------------------------------------------------


def test_same_seed_same_samples_and_different_seeds_differ(model, tiny_tokenizer, prompts):
    def run(seed):
        return HFGenerator(model, tiny_tokenizer, seed=seed, stop_strings=())(prompts, [15] * len(prompts))

    assert run(7) == run(7)
    assert [s.token_ids for s in run(7)] != [s.token_ids for s in run(8)]


def test_rollouts_of_one_prompt_differ_within_and_across_calls(model, tiny_tokenizer, prompts):
    generator = HFGenerator(model, tiny_tokenizer, seed=0, stop_strings=())
    first = generator([prompts[0]] * 4, [15] * 4)
    second = generator([prompts[0]] * 4, [15] * 4)
    assert len({tuple(s.token_ids) for s in first + second}) == 8


# --- finish reasons -----------------------------------------------------------------------------------------------


def test_stop_eos_and_length_in_one_batch(model, tiny_tokenizer, prompts):
    tok = tiny_tokenizer
    one, two, three, seven, eight = (single_id(tok, digit) for digit in "12378")
    script = encode_segment(tok, f"print(x)\n{CODE_CLOSE}\n<interpreter>")
    # The shortest prefix that contains the stop string; its last id decodes to the stop string and more text.
    until_stop = next(script[:n] for n in range(1, len(script) + 1) if CODE_CLOSE in tok.decode(script[:n]))
    assert not tok.decode(until_stop).endswith(CODE_CLOSE) and len(until_stop) < len(script)
    by_char = [single_id(tok, char) for char in CODE_CLOSE]  # the stop string spread over one id per character
    rows = prompts
    assert len({p[-1] for p in rows}) == len(rows), "each row is triggered by its own last prompt id"
    successors = chains_to_successors(
        [
            [rows[0][-1], *script],
            [rows[1][-1], seven, eight, tok.eos_token_id],
            [rows[2][-1], one, two, three, one],
            [rows[3][-1], one],
            [rows[4][-1], *by_char],
        ]
    )
    forced = ForcedLM(model, successors)
    samples = HFGenerator(forced, tok, seed=0)(rows, [20, 20, 5, 9, 20])

    assert [s.finish_reason for s in samples] == ["stop", "eos", "length", "length", "stop"]
    assert samples[0].token_ids == until_stop
    assert samples[1].token_ids == [seven, eight, tok.eos_token_id]
    assert samples[2].token_ids == [one, two, three, one, two]
    assert samples[3].token_ids == [one, two, three, one, two, three, one, two, three]
    assert samples[4].token_ids == by_char
    for sample in samples:
        assert sample.logprobs == pytest.approx([0.0] * len(sample.token_ids), abs=1e-6)  # forced ids: probability 1


def test_max_turn_tokens_caps_every_row(model, tiny_tokenizer, prompts):
    samples = HFGenerator(model, tiny_tokenizer, temperature=0, stop_strings=(), max_turn_tokens=4)(
        prompts[:2], [2, 10]
    )
    assert [len(s.token_ids) for s in samples] == [2, 4]


def test_rows_stop_at_max_position_embeddings(tiny_model_dir, tiny_tokenizer, prompts):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    short, long = prompts[0], prompts[1]
    model.config.max_position_embeddings = len(short) + 3
    forced = ForcedLM(model, chains_to_successors([[short[-1], 5], [5, 5]]))  # never EOS, never a stop string
    samples = HFGenerator(forced, tiny_tokenizer, seed=0)([short, long, short[:2] + short[-1:]], [10, 10, 1])
    assert [(len(s.token_ids), s.finish_reason) for s in samples] == [(3, "length"), (0, "length"), (1, "length")]


# --- batching, modes, arguments -----------------------------------------------------------------------------------


def test_chunked_batch_equals_one_batch(model, tiny_tokenizer, prompts):
    budgets = [8, 3, 10, 6, 9]

    def run(max_batch_size):
        generator = HFGenerator(model, tiny_tokenizer, temperature=0, stop_strings=(), max_batch_size=max_batch_size)
        return generator(prompts, budgets), generator.stats

    (one_batch, one_stats), (chunked, chunked_stats) = run(64), run(2)
    assert [s.token_ids for s in chunked] == [s.token_ids for s in one_batch]
    torch.testing.assert_close(
        torch.tensor(sum((s.logprobs for s in chunked), [])),
        torch.tensor(sum((s.logprobs for s in one_batch), [])),
        atol=1e-4,
        rtol=0,
    )
    assert chunked_stats.generated_tokens == one_stats.generated_tokens == sum(len(s.token_ids) for s in chunked)
    assert one_stats.forward_passes == max(len(s.token_ids) for s in one_batch)
    assert chunked_stats.forward_passes > one_stats.forward_passes and chunked_stats.tokens_per_second > 0


def test_model_mode_is_restored(model, tiny_tokenizer, prompts):
    model.train()
    try:
        HFGenerator(model, tiny_tokenizer, temperature=0)(prompts[:2], [3, 3])
        assert model.training
    finally:
        model.eval()
    HFGenerator(model, tiny_tokenizer, temperature=0)(prompts[:2], [3, 3])
    assert not model.training


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_turn_tokens": 0}, "max_turn_tokens must be >= 1 or None"),
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
        ({"stop_strings": CODE_CLOSE}, "stop_strings must be a sequence of non-empty strings"),
        ({"stop_strings": ("",)}, "stop_strings must be a sequence of non-empty strings"),
    ],
)
def test_bad_settings_are_rejected(model, tiny_tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        HFGenerator(model, tiny_tokenizer, **kwargs)


@pytest.mark.parametrize(
    ("batch", "budgets", "message"),
    [
        ([[1, 2]], [3, 3], "1 prompts but 2 max_new_tokens"),
        ([[1, 2], []], [3, 3], "prompt 1 is empty"),
        ([[1, 2]], [0], r"max_new_tokens\[0\] must be >= 1"),
    ],
)
def test_bad_calls_are_rejected(model, tiny_tokenizer, batch, budgets, message):
    with pytest.raises(ValueError, match=message):
        HFGenerator(model, tiny_tokenizer)(batch, budgets)
