"""The tiny-model factory: exact round trips, identical ids after AutoTokenizer reload, and a usable model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stare_agent.lab.models import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, tiny_corpus, train_tokenizer

STRINGS = [
    "",
    "hello world",
    "  leading spaces",
    "trailing spaces   ",
    "\n\n",
    "\t",
    "a\tb\r\nc\n\n\nd",
    "é ü 中文 😀",
    "naïve café ß Ω ∑ ∫ → ≤",
    "\\frac{1}{2} + \\sqrt{x^{2}} = \\boxed{\\dfrac{3}{4}}",
    "$\\int_0^1 x\\,dx$ and \\(\\pi\\)",
    "def f(x):\n    if x > 0:\n        return x ** 2\n\treturn -x  # done\n",
    "<code>\nprint(12345 * 678)\n</code>\n<interpreter>\n8369910\n</interpreter>\n<answer>\\boxed{8369910}</answer>",
    "don't, it's x , y . z ! ?",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "word<|endoftext|>word",
    "zzzqqq unseen-token xylophone 0x1F",
]


@pytest.fixture(scope="module")
def trained():
    """The in-memory tokenizer, trained on the same corpus as the one saved in `tiny_model_dir`."""
    return train_tokenizer(tiny_corpus())


@pytest.fixture(scope="module", params=["trained", "reloaded"])
def any_tokenizer(request, trained, tiny_tokenizer):
    return trained if request.param == "trained" else tiny_tokenizer


@pytest.mark.parametrize("text", STRINGS)
def test_round_trip_is_exact(any_tokenizer, text):
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    assert any_tokenizer.decode(ids) == text


def test_reloaded_tokenizer_gives_identical_ids(trained, tiny_tokenizer):
    for text in STRINGS + tiny_corpus()[::7]:
        assert tiny_tokenizer.encode(text) == trained.encode(text), text
    assert tiny_tokenizer.get_vocab() == trained.get_vocab()
    assert len(tiny_tokenizer) == len(trained)


def test_reloaded_tokenizer_uses_the_pipeline_we_trained_with(trained, tiny_tokenizer):
    # transformers 5 rebuilds the normalizer / pre-tokenizer / decoder in Qwen2Tokenizer.__init__ and ignores those
    # in tokenizer.json; if a new release changes them, this fails before the ids silently drift apart.
    assert type(tiny_tokenizer).__name__ == "Qwen2Tokenizer"
    ours = json.loads(trained.backend_tokenizer.to_str())
    theirs = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        assert theirs[part] == ours[part], part


def test_text_is_nfc_normalized_like_qwen2(any_tokenizer):
    decomposed, composed = "cafe\u0301", "caf\u00e9"
    assert any_tokenizer.encode(decomposed) == any_tokenizer.encode(composed)
    assert any_tokenizer.decode(any_tokenizer.encode(decomposed)) == composed


def test_special_tokens_are_single_ids(any_tokenizer):
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert any_tokenizer.encode(token, add_special_tokens=False) == [expected_id]
        assert any_tokenizer.convert_tokens_to_ids(token) == expected_id
    assert any_tokenizer.eos_token == "<|im_end|>" and any_tokenizer.eos_token_id == 2
    assert any_tokenizer.pad_token == "<|endoftext|>" and any_tokenizer.pad_token_id == 0
    assert set(any_tokenizer.all_special_tokens) == set(SPECIAL_TOKENS)
    ids = any_tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert any_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_single_tokens(any_tokenizer):
    tokens = any_tokenizer.tokenize("x = 1234567890 + 42")
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("1234567890") + ["4", "2"]


def test_training_is_deterministic(trained):
    again = train_tokenizer(tiny_corpus())
    assert again.backend_tokenizer.to_str() == trained.backend_tokenizer.to_str()


def test_vocab_size_is_an_upper_bound():
    corpus = [
        f"line {i}: " + " ".join(f"w{chr(97 + i % 26)}{chr(97 + j % 26)}x" for j in range(40)) for i in range(200)
    ]
    assert len(train_tokenizer(corpus, vocab_size=300)) == 300
    assert len(train_tokenizer(["a b"], vocab_size=2048)) == len(SPECIAL_TOKENS) + 256 + 1  # one merge: " b"
    with pytest.raises(ValueError, match="vocab_size must be at least 259"):
        train_tokenizer(["x"], vocab_size=100)


def test_chat_template_renders_chatml(any_tokenizer):
    assert any_tokenizer.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "\\boxed{4}"},
    ]
    expected = (
        "<|im_start|>system\nUse the tool.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n\\boxed{4}<|im_end|>\n"
    )
    assert any_tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = any_tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected.rsplit("<|im_start|>assistant", 1)[0] + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_model_config_matches_the_tokenizer(model, tiny_tokenizer):
    config = model.config
    assert config.model_type == "qwen2" and model.dtype == torch.float32
    assert config.vocab_size == len(tiny_tokenizer)
    assert model.model.layers[0].self_attn.head_dim == config.hidden_size // config.num_attention_heads >= 32
    assert config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for source in (config, model.generation_config):
        assert source.eos_token_id == tiny_tokenizer.eos_token_id
        assert source.pad_token_id == source.bos_token_id == tiny_tokenizer.pad_token_id


def test_forward_and_generate(model, tiny_tokenizer):
    batch = tiny_tokenizer(["What is 2+2?", "<code>\nprint(1)\n</code>"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tiny_tokenizer))
    assert torch.isfinite(logits).all()
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and prompt["input_ids"].shape[1] < out.shape[1] <= prompt["input_ids"].shape[1] + 5


def test_same_seed_same_weights_and_global_rng_untouched(tmp_path):
    corpus = tiny_corpus()[:50]
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_tiny_model(tmp_path / "a", corpus, seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    second = build_tiny_model(tmp_path / "b", corpus, seed=7)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(second).get_vocab() == AutoTokenizer.from_pretrained(first).get_vocab()


@pytest.mark.parametrize(
    "shape, message",
    [
        (dict(hidden_size=128, num_heads=8), "head_dim"),
        (dict(hidden_size=130, num_heads=4), "must divide"),
        (dict(num_heads=4, num_kv_heads=3), "must divide"),
    ],
)
def test_build_rejects_bad_shapes(tmp_path, shape, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path, ["x"], **shape)


def test_a_scripted_model_follows_its_script_and_leaves_other_ids_alone(tiny_model_dir, tmp_path):
    from stare_agent.lab.models import scripted_successors, write_scripted_model

    successors = scripted_successors([[40, 41, 42, 40]])  # a cycle: 40 -> 41 -> 42 -> 40
    scripted = write_scripted_model(tiny_model_dir, tmp_path / "scripted", successors)
    model = AutoModelForCausalLM.from_pretrained(scripted).eval()
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([[7, 40]]), max_new_tokens=6, do_sample=False)
        assert out[0, 2:].tolist() == [41, 42, 40, 41, 42, 40]
        probs = model(torch.tensor([[7, 41]])).logits[0, -1].softmax(-1)
        assert probs[42] > 0.999
        # an id outside the script still reads the source model's other dimensions: its next-id ranking is close
        theirs, ours = (m(torch.tensor([[7, 9]])).logits[0, -1] for m in (source, model))
        assert torch.corrcoef(torch.stack([theirs, ours]))[0, 1] > 0.9  # measured 0.95-0.99


def test_a_script_needs_an_id_to_have_one_successor_and_the_model_a_dimension_per_id(tiny_model_dir, tmp_path):
    from stare_agent.lab.models import scripted_successors, write_scripted_model

    with pytest.raises(ValueError, match="id 5 is followed by 6 and by 7"):
        scripted_successors([[5, 6], [5, 7]])
    too_many = {token: token + 1 for token in range(100, 165)}  # 65 ids; the tiny model's hidden size is 128
    with pytest.raises(ValueError, match="65 scripted ids need as many of the model's 128 hidden dimensions"):
        write_scripted_model(tiny_model_dir, tmp_path / "scripted", too_many)
