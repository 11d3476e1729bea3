"""Turning (prompt, response) text into token ids the same way for the policy, the RM and SFT.

Prompt and response are tokenized separately and concatenated, without added special tokens: that is
exactly what the policy sees when it continues a prompt. A finished response ends with the eos token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a prompt (no special tokens added)."""
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def encode_pair(
    tokenizer: PreTrainedTokenizerBase, prompt: str, response: str, add_eos: bool = True
) -> list[int]:
    """``prompt ids + response ids (+ eos)``; the RM scores what the policy would have produced."""
    ids = encode_prompt(tokenizer, prompt) + list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token; set tokenizer.eos_token")
        ids.append(tokenizer.eos_token_id)
    return ids


def keep_tail(ids: list[int], max_length: int, prefix: Sequence[int] = ()) -> tuple[list[int], bool]:
    """``prefix`` + the last ``max_length - len(prefix)`` ids (the reply is at the end). Returns (ids, was_cut)."""
    room = max_length - len(prefix)
    if room < 1:
        raise ValueError(f"max_length {max_length} leaves no room after the {len(prefix)} prefix token(s)")
    return list(prefix) + ids[-room:], len(ids) > room


def right_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``(ids (B, T), attention_mask (B, T) long)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id (it may equal eos: masks, not ids, tell padding apart)."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no pad token; set one in the config (sft.tokens.pad / "
            "reward_model.tokens.pad), or load it through rlhf_core.models.tokenizer.resolve_special_tokens (pad = eos)"
        )
    return int(tokenizer.pad_token_id)


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when two tokenizers map text to the same ids (so ids can be shared without re-tokenizing)."""
    return a is b or a.get_vocab() == b.get_vocab()
