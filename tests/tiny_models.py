"""Builders of tiny tokenizers and GPT-2 configs for tests (no downloads)."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>"]
WORDS = [
    "good", "bad", "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "red", "blue", "big", "small",
    "fast", "slow", "tree", "box", "sun", "moon", "star", "q", "hello", "why", "how",
]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: pad=0, bos=1, eos=2, then WORDS."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def gpt2_config(vocab_size: int, **overrides: int) -> GPT2Config:
    """A ~30k-parameter GPT-2 with dropout off."""
    settings = dict(
        vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    settings.update(overrides)
    return GPT2Config(**settings)
