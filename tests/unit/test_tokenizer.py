"""The byte-level BPE tokenizer: special tokens, round trips, save/reload."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlhf_core.models.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    PAD_TOKEN,
    check_special_tokens,
    train_bpe_tokenizer,
)

CORPUS = [
    "Q: My blender arrived broken, order 1234. A: I am sorry to hear that. I will send a replacement.",
    "Q: Where is my parcel? A: Sorry for the wait. Your package ships today.",
    "Q: I was charged twice! A: Apologies. I have refunded the second charge.",
] * 5

ROUND_TRIP_TEXTS = [
    " I am sorry to hear that.",  # a reply: a continuation that starts with a space
    "  two leading spaces and  double gaps",
    "Q: order 1234 , comma after a space?",
    "line one\nline two\ttab",
    "unseen bytes: café, naïve, ✓, 数字",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(CORPUS, vocab_size=320)


def test_special_tokens_are_distinct_and_named(tokenizer: PreTrainedTokenizerFast) -> None:
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_vocabulary_has_merges_beyond_bytes(tokenizer: PreTrainedTokenizerFast) -> None:
    assert 259 < len(tokenizer) <= 320
    # Frequent words take fewer tokens than bytes (that is what BPE training is for).
    assert len(tokenizer(" sorry").input_ids) < len(b" sorry")
    assert len(tokenizer(" the").input_ids) == 1


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_encode_round_trip(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text


def test_no_special_tokens_are_added(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("Q: hello", add_special_tokens=True).input_ids
    assert not {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} & set(ids)


def test_leading_space_is_kept_as_part_of_the_token(tokenizer: PreTrainedTokenizerFast) -> None:
    with_space = tokenizer(" sorry").input_ids
    without = tokenizer("sorry").input_ids
    assert with_space != without
    assert tokenizer.decode(without + with_space) == "sorry sorry"


def test_prompt_then_reply_ids_decode_to_the_joined_text(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt, reply = "Q: Where is my parcel?", " A: It ships today."
    ids = tokenizer(prompt).input_ids + tokenizer(reply).input_ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt + reply
    assert tokenizer.decode(ids).endswith(EOS_TOKEN)


def test_save_and_reload_with_auto_tokenizer(tokenizer: PreTrainedTokenizerFast, tmp_path) -> None:
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(reloaded) == len(tokenizer)
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (0, 1, 2)
    for text in ROUND_TRIP_TEXTS:
        assert reloaded(text).input_ids == tokenizer(text).input_ids
        assert reloaded.decode(reloaded(text).input_ids) == text


def test_padding_side_is_the_callers_choice(tokenizer: PreTrainedTokenizerFast) -> None:
    tokenizer.padding_side = "left"
    batch = tokenizer(["Q:", "Q: Where is my parcel?"], padding=True).input_ids
    tokenizer.padding_side = "right"
    assert batch[0][0] == tokenizer.pad_token_id and batch[0][-1] != tokenizer.pad_token_id


def test_training_is_deterministic() -> None:
    first = train_bpe_tokenizer(CORPUS, vocab_size=300)
    second = train_bpe_tokenizer(CORPUS, vocab_size=300)
    assert first.get_vocab() == second.get_vocab()


def test_too_small_vocabulary_is_rejected() -> None:
    with pytest.raises(ValueError, match=str(MIN_VOCAB_SIZE)):
        train_bpe_tokenizer(CORPUS, vocab_size=MIN_VOCAB_SIZE - 1)


def test_pad_equal_to_eos_is_rejected(tokenizer: PreTrainedTokenizerFast) -> None:
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    shared = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=EOS_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )
    with pytest.raises(ValueError, match="distinct"):
        check_special_tokens(shared)
