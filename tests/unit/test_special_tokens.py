"""Special tokens from the config, else the tokenizer's own, else the fallbacks (eos: sep, bos: cls, pad: eos)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf_core.models.tokenizer import SpecialTokens, check_stop_and_pad, resolve_special_tokens


def tokenizer(**specials: str) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[CLS]", "[SEP]", "<eos>", "<|im_end|>", "hello", "world"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, **specials)


def roles(tok: PreTrainedTokenizerFast) -> tuple[str | None, str | None, str | None]:
    return tok.eos_token, tok.bos_token, tok.pad_token


def test_an_encoders_sep_and_cls_stand_in_for_eos_and_bos():
    tok = resolve_special_tokens(tokenizer(sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]"))
    assert roles(tok) == ("[SEP]", "[CLS]", "[PAD]")


def test_a_decoder_without_a_pad_token_pads_with_eos():
    tok = resolve_special_tokens(tokenizer(eos_token="<eos>"))
    assert roles(tok) == ("<eos>", None, "<eos>") and tok.pad_token_id == tok.eos_token_id == 3
    check_stop_and_pad(tok)  # pad == eos is allowed: batches carry their masks


def test_the_config_wins_over_the_tokenizer_and_the_fallbacks():
    tok = resolve_special_tokens(tokenizer(eos_token="<eos>", sep_token="[SEP]"),
                                 SpecialTokens(eos="<|im_end|>", bos="[CLS]", pad="[PAD]"), "sft.tokens")
    assert roles(tok) == ("<|im_end|>", "[CLS]", "[PAD]") and tok.eos_token_id == 4


def test_a_token_that_is_not_in_the_vocabulary_or_no_eos_at_all_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^sft.tokens.eos='<\|eot\|>' is not a token of .*embeddings are not "
                                         r"resized") as info:
        resolve_special_tokens(tokenizer(eos_token="<eos>"), SpecialTokens(eos="<|eot|>"), "sft.tokens")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"has no eos \(or sep\) token to end replies with; set "
                                         r"reward_model.tokens.eos"):
        resolve_special_tokens(tokenizer(pad_token="[PAD]"), SpecialTokens(), "reward_model.tokens")
