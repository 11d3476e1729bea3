"""Tiny checkpoints of several Hugging Face model families, each saved with its own tokenizer (no downloads).

What a user brings as "their own model" differs by family in ways our code must not assume away:

- ``bert`` (encoder): WordPiece, ``[CLS]``/``[SEP]`` added by the tokenizer's post-processor, no eos or bos, the
  classifier reads the first (``[CLS]``) position;
- ``gpt2``: byte-level BPE whose only special token is ``<|endoftext|>`` (bos = eos = unk) and no pad token;
- ``llama``: BPE over ``▁``-marked words with ``<s>``, ``</s>``, ``<unk>``, ``<s>`` added by the post-processor,
  and no pad token;
- ``gpt_neox``: byte-level BPE with ``<|endoftext|>`` (bos = eos) and a ``<|padding|>`` pad token.

Every model is ~30-60k parameters (hidden 32, 2 layers, 2 heads) with dropout off; every builder saves the model and
its tokenizer into one folder with ``save_pretrained`` and returns the folder.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    GPTNeoXModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from tests.tiny_models import WORDS

ENCODERS = ("bert",)
DECODERS = ("gpt2", "llama", "gpt_neox")
FAMILIES = ENCODERS + DECODERS

HIDDEN = 32
#: Positions every model takes: enough for any prompt + reply the tests build.
MAX_POSITIONS = 128

#: What the tokenizers are trained on: the tiny-model words and a few demo-like exchanges.
CORPUS = [
    " ".join(WORDS),
    "q the cat sat on the mat",
    "q why did the dog run",
    "q how big is the sun",
    "hello the red box is good",
    "the blue star is bad",
    "a small tree and a big moon",
    "the fast dog ran on the mat good good",
    "the slow cat sat in the box bad bad",
    "why is the moon so slow",
    "how fast is a star",
] * 3

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
GPT2_EOS = "<|endoftext|>"
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
NEOX_SPECIALS = ("<|endoftext|>", "<|padding|>")


# ----------------------------------------------------------------------------------------------- tokenizers


@functools.cache
def _trained(family: str) -> str:
    """The family's trained ``tokenizers`` backend as JSON (training once per session; each caller gets a copy)."""
    if family == "bert":
        core = _wordpiece(models.WordPiece(unk_token="[UNK]"))
        # The trainer numbers the "##" pieces it makes in hash-map order, which differs per process, and breaks ties
        # by those numbers (huggingface/tokenizers#1794): given every piece up front, in sorted order, it makes the
        # same vocabulary in every process; the tokenizer is then rebuilt with only the real special tokens.
        words = [word for text in CORPUS
                 for word, _ in core.pre_tokenizer.pre_tokenize_str(core.normalizer.normalize_str(text))]
        pieces = [f"##{char}" for char in sorted({char for word in words for char in word[1:]})]
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=[*BERT_SPECIALS, *pieces],
                                            show_progress=False)
        core.train_from_iterator(CORPUS, trainer=trainer)
        core = _wordpiece(models.WordPiece(vocab=core.get_vocab(), unk_token="[UNK]"))
        core.add_special_tokens(list(BERT_SPECIALS))
        cls, sep = core.token_to_id("[CLS]"), core.token_to_id("[SEP]")
        # Real BERT tokenizers add [CLS] ... [SEP] unless told not to: our code must not rely on either.
        core.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
    elif family in ("gpt2", "gpt_neox"):
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        specials = [GPT2_EOS] if family == "gpt2" else list(NEOX_SPECIALS)
        trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        core.train_from_iterator(CORPUS, trainer=trainer)
    elif family == "llama":
        core = Tokenizer(models.BPE(unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=list(LLAMA_SPECIALS), show_progress=False)
        core.train_from_iterator(CORPUS, trainer=trainer)
        # Like Llama-2's tokenizer: <s> in front of every encoding that asks for special tokens.
        core.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", core.token_to_id("<s>"))]
        )
    else:
        raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")
    return core.to_str()


def _wordpiece(model: models.WordPiece) -> Tokenizer:
    """A BERT-style (lowercasing, punctuation-splitting) tokenizer around a WordPiece model."""
    core = Tokenizer(model)
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    return core


def build_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A fresh transformers tokenizer of ``family`` with the special tokens real checkpoints of it have."""
    core = Tokenizer.from_str(_trained(family))
    if family == "bert":
        specials = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                        mask_token="[MASK]")
    elif family == "gpt2":
        specials = dict(bos_token=GPT2_EOS, eos_token=GPT2_EOS, unk_token=GPT2_EOS)
    elif family == "llama":
        specials = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    else:
        specials = dict(bos_token=GPT2_EOS, eos_token=GPT2_EOS, unk_token=GPT2_EOS, pad_token="<|padding|>")
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=MAX_POSITIONS,
                                   clean_up_tokenization_spaces=False, **specials)


# ----------------------------------------------------------------------------------------------- models


def config(family: str, **overrides: object) -> PretrainedConfig:
    """The family's tiny config, its special-token ids taken from its tokenizer, dropout off."""
    tok = build_tokenizer(family)
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    shape = dict(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=2 * HIDDEN, max_position_embeddings=MAX_POSITIONS)
    if family == "bert":
        settings = dict(**shape, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        pad_token_id=tok.pad_token_id)
        made = BertConfig(**settings)
    elif family == "gpt2":
        made = GPT2Config(vocab_size=len(tok), n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=MAX_POSITIONS,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, **ids)
    elif family == "llama":
        made = LlamaConfig(**shape, num_key_value_heads=1, attention_dropout=0.0, tie_word_embeddings=False, **ids)
    elif family == "gpt_neox":
        made = GPTNeoXConfig(**shape, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False, **ids)
    else:
        raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")
    for key, value in overrides.items():
        setattr(made, key, value)
    return made


REWARD_CLASSES = {"bert": BertForSequenceClassification, "gpt2": GPT2ForSequenceClassification,
                  "llama": LlamaForSequenceClassification, "gpt_neox": GPTNeoXForSequenceClassification}
BASE_CLASSES = {"bert": BertModel, "gpt2": GPT2Model, "llama": LlamaModel, "gpt_neox": GPTNeoXModel}
POLICY_CLASSES = {"bert": BertForMaskedLM, "gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM,
                  "gpt_neox": GPTNeoXForCausalLM}


def save(model: PreTrainedModel, family: str, folder: str | Path) -> str:
    """``save_pretrained`` the model and a fresh copy of the family's tokenizer into ``folder``; returns it."""
    model.save_pretrained(folder)
    build_tokenizer(family).save_pretrained(folder)
    return str(folder)


def save_reward_model(family: str, folder: str | Path, num_labels: int = 1, seed: int = 0,
                      **overrides: object) -> str:
    """A randomly initialised sequence classifier with ``num_labels`` outputs; ``overrides`` go to its config
    (``initializer_range=0.3``: weights large enough that every token moves the score)."""
    torch.manual_seed(seed)
    model = REWARD_CLASSES[family](config(family, num_labels=num_labels, **overrides))
    return save(model, family, folder)


def save_base_model(family: str, folder: str | Path, seed: int = 0) -> str:
    """The bare backbone (``BertModel``, ``GPT2Model`` ...): a "base checkpoint" with no head at all."""
    torch.manual_seed(seed)
    return save(BASE_CLASSES[family](config(family)), family, folder)


def save_policy(family: str, folder: str | Path, seed: int = 0, stop_probability: float = 0.0) -> str:
    """A causal LM for a decoder family; for ``bert`` a masked LM (bidirectional), which is no policy.

    ``stop_probability`` > 0 makes the random model sample its eos token with about that probability at every
    position, so that short rollouts stop (:func:`lean_towards_stop`).
    """
    torch.manual_seed(seed)
    model = POLICY_CLASSES[family](config(family))
    if stop_probability:
        lean_towards_stop(model, build_tokenizer(family).eos_token_id, stop_probability)
    return save(model, family, folder)


@torch.no_grad()
def lean_towards_stop(model: PreTrainedModel, eos_id: int, probability: float) -> None:
    """Make a random causal LM sample eos with about ``probability`` at every position, in place.

    A random model's logits are all near 0, so eos needs a logit of ``log(p / (1 - p) * (V - 1))``. Every input
    embedding gets a shared component along a zero-mean direction ``d`` (LayerNorm keeps it, RMSNorm too), so the
    last hidden state always points partly along ``d`` (about ``0.9 sqrt(H)`` after the final norm); the eos
    output row gets ``d`` scaled to give that logit. Works whatever the norm and whether the output embeddings are
    tied (a tied eos row just gets both parts).
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    logit = math.log(probability / (1.0 - probability) * (vocab - 1))
    direction = torch.zeros(HIDDEN)
    direction[0::2], direction[1::2] = 1.0, -1.0
    direction /= direction.norm()
    model.get_input_embeddings().weight.add_(0.3 * direction)
    model.get_output_embeddings().weight[eos_id].add_(logit / (0.9 * HIDDEN**0.5) * direction)
