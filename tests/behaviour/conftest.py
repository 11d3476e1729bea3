"""Tiny models and tokenizers built from configs (no downloads) for behaviour tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

from tests.tiny_models import gpt2_config, word_tokenizer


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.fixture
def tiny_policy_dir(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A randomly initialised tiny causal LM saved with save_pretrained."""
    torch.manual_seed(0)
    path = tmp_path / "policy"
    GPT2LMHeadModel(gpt2_config(len(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def tiny_reward_dir(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A randomly initialised tiny 1-label sequence classifier saved with save_pretrained."""
    torch.manual_seed(1)
    path = tmp_path / "reward"
    GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
