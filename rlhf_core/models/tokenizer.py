"""A small byte-level BPE tokenizer trained on the task's own text (no downloads).

Byte-level means every string round-trips through ``decode(encode(text))``: any byte sequence has an
encoding, so there is no unknown token, and spaces are part of the tokens (``" yes"`` and ``"yes"`` are
different ids). Replies are continuations that start with a space; encoding the prompt and the reply
separately and concatenating the ids is exactly what generation sees.

The tokenizer adds NO special tokens on its own (no post-processor): ``tokenizer(text)`` gives the same ids
in SFT, reward-model training and rollouts. Callers append ``eos`` where a sequence ends and choose
``tokenizer.padding_side`` explicitly ("right" for training batches, "left" for generation).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: Padding. Distinct from EOS, so a padded batch reads unambiguously by eye; the code never tells padding from a
#: stop token by id (every batch carries its mask), so a checkpoint whose pad falls back to eos works the same.
PAD_TOKEN = "<|pad|>"
#: Beginning of sequence. Not added automatically; available for models or callers that want one.
BOS_TOKEN = "<|bos|>"
#: End of sequence: the stop token appended after every reply and used to end generation.
EOS_TOKEN = "<|eos|>"
#: Special tokens in id order: pad = 0, bos = 1, eos = 2.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

#: 256 byte symbols plus the special tokens; a smaller vocabulary has no room for a single merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` with pad/bos/eos special tokens (ids 0/1/2).

    Returns a ``PreTrainedTokenizerFast`` that ``save_pretrained`` writes and
    ``AutoTokenizer.from_pretrained`` reads back. ``model_max_length`` should be the model's
    ``n_positions`` when known. Training is single-pass over ``texts`` and deterministic for the same input.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens); use at least {MIN_VOCAB_SIZE}"
        )
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False: a reply's leading space must stay in the text, not be invented for prompts.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(backend, model_max_length)


def wrap_tokenizer(backend: Tokenizer, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` that holds the special tokens into a transformers tokenizer."""
    for token in SPECIAL_TOKENS:
        if backend.token_to_id(token) is None:
            raise ValueError(f"tokenizer has no {token!r} token; train it with train_bpe_tokenizer")
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # The default cleanup rewrites " ," into "," and would break the decode/encode round trip.
        clean_up_tokenization_spaces=False,
        **extra,
    )
    check_special_tokens(tokenizer)
    return tokenizer


def check_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise if pad, bos or eos is missing or if two of them share an id: the tokenizer a GPT is built here for (its
    config takes three distinct ids). Loaded checkpoints need only :func:`check_stop_and_pad`."""
    ids = {
        "pad": tokenizer.pad_token_id,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
    }
    missing = [name for name, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"tokenizer lacks special token(s) {missing}; add them or use train_bpe_tokenizer")
    if len(set(ids.values())) != len(ids):
        raise ValueError(
            f"special token ids must be distinct, got {ids}; a GPT built here takes three distinct ids "
            "(add a dedicated pad token, e.g. tokenizer.add_special_tokens({'pad_token': '<|pad|>'}))"
        )


@dataclass(frozen=True)
class SpecialTokens:
    """Special tokens to use instead of (or where there are none) those a tokenizer was saved with, given as the token
    text (e.g. ``eos: "<|im_end|>"``). Each must already be in the vocabulary: no embedding is added or resized."""

    eos: str | None = None
    """The stop token appended to every reply and ending generation; None = the tokenizer's eos, else its sep
    (an encoder's ``[SEP]``)."""
    bos: str | None = None
    """The token an encoder reward model's input starts with (its head reads that position); None = the tokenizer's
    bos, else its cls (``[CLS]``). Decoders do not use it."""
    pad: str | None = None
    """Filler of padded batches (never attended to: every batch carries its mask); None = the tokenizer's pad, else
    its eos."""


def resolve_special_tokens(tokenizer: PreTrainedTokenizerBase, tokens: SpecialTokens = SpecialTokens(),
                           setting: str = "tokens") -> PreTrainedTokenizerBase:
    """``tokenizer`` (changed in place) with eos, bos and pad set: ``tokens`` where given, else the tokenizer's own,
    else the fallbacks (eos: sep; bos: cls; pad: eos). ValueError in one line naming ``setting`` when a given token
    is not in the vocabulary or no eos can be found."""
    name = tokenizer.name_or_path or type(tokenizer).__name__
    given = {role: getattr(tokens, role) for role in ("eos", "bos", "pad") if getattr(tokens, role) is not None}
    vocab = tokenizer.get_vocab() if given else {}  # a large vocabulary's map is built only to check given tokens
    for role, token in given.items():
        if token not in vocab:
            raise ValueError(f"{setting}.{role}={token!r} is not a token of {name!r}; give one of its tokens "
                             "(embeddings are not resized for new ones)")
        setattr(tokenizer, f"{role}_token", token)
    if tokenizer.eos_token is None and getattr(tokenizer, "sep_token", None) is not None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.bos_token is None and getattr(tokenizer, "cls_token", None) is not None:
        tokenizer.bos_token = tokenizer.cls_token
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer {name!r} has no eos (or sep) token to end replies with; set {setting}.eos to "
                         "one of its tokens")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_stop_and_pad(tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise unless the tokenizer has an eos (the stop token) and a pad token. pad may equal eos: every batch
    carries an explicit mask, so no stop token is ever told apart from padding by its id."""
    missing = [role for role in ("eos", "pad") if getattr(tokenizer, f"{role}_token_id") is None]
    if missing:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} lacks special token(s) {missing}; set them in the "
                         "config (sft.tokens / reward_model.tokens) or use train_bpe_tokenizer")
