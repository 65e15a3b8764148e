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
