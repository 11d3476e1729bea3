"""Builders of tiny tokenizers and GPT-2 configs for tests (no downloads)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

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


def save_ppo_inputs(root: Path, prompts: Sequence[str]) -> dict[str, str]:
    """What a ppo-iteration stage reads, saved under ``root``: a word-tokenizer GPT-2 policy (seed 0), a reward
    model of the same shape (seed 1) and a prompt table. -> {"sft": dir, "rm": dir, "prompts": parquet}."""
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(len(tokenizer))).save_pretrained(root / "sft")
    torch.manual_seed(1)
    GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1)).save_pretrained(root / "rm")
    for name in ("sft", "rm"):
        tokenizer.save_pretrained(root / name)
    pq.write_table(pa.table({"prompt": list(prompts)}), root / "prompts.parquet")
    return {"sft": str(root / "sft"), "rm": str(root / "rm"), "prompts": str(root / "prompts.parquet")}


def save_model_dir(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: Path) -> str:
    """``save_pretrained`` model and tokenizer into ``path``; returns it as a string."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def good_token_reward_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> GPT2ForSequenceClassification:
    """Scores the LAST token only: cosine of LN(wte[last]) with LN(wte['good']), so 1.0 for 'good', < 1 else.

    Blocks add nothing (zero output projections) and positions are zero, so the last hidden state is
    LN(wte[last token]) and the linear head reads it.
    """
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    with torch.no_grad():
        for block in model.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.transformer.wpe.weight.zero_()
        good = model.transformer.ln_f(model.transformer.wte.weight[tokenizer.convert_tokens_to_ids("good")])
        model.score.weight.copy_((good / good.norm() ** 2).unsqueeze(0))
    return model
