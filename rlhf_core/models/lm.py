"""Small GPT-2 models built from a config (no downloads): the policy and the reward model.

Any Hugging Face causal LM works in their place on a machine that has one; these exist so the demo and the
tests can build their own weights. Parameter counts are dominated by ``12 * n_layer * n_embd**2`` (the
blocks) plus ``(vocab_size + n_positions) * n_embd`` (embeddings; the output layer is tied to them).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf_core.models.roles import fuse_activations
from rlhf_core.models.tokenizer import check_special_tokens


@dataclass(frozen=True)
class ModelSize:
    """Shape of a GPT-2 style model."""

    n_layer: int
    """Transformer blocks."""
    n_embd: int
    """Hidden width; must be divisible by ``n_head``."""
    n_head: int
    """Attention heads (head width = n_embd / n_head)."""
    n_positions: int
    """Longest sequence (prompt + reply) the model can see; learned position embeddings."""


#: Named sizes. Counts below are for a 400-token vocabulary (tiny) and a 2,000-token one (demo).
PRESETS: dict[str, ModelSize] = {
    # ~83k params: 2 blocks of width 48 (55k) + 19k token and 6k position embeddings (128 positions: a demo
    # prompt of ~50 tokens plus a reply must fit). Big enough to learn
    # a templated task in a few hundred CPU steps, small enough for unit tests that take seconds.
    "tiny": ModelSize(n_layer=2, n_embd=48, n_head=4, n_positions=128),
    # ~1.1M params: 4 blocks of width 128 (0.79M) + 0.26M token embeddings. Fits the customer-support
    # demo (replies of a few dozen tokens, 256 positions for prompt + reply) and trains on a laptop CPU.
    "demo": ModelSize(n_layer=4, n_embd=128, n_head=4, n_positions=256),
}


def model_size(name: str) -> ModelSize:
    """The preset called ``name`` (see ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model size {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def tiny_gpt_config(
    vocab_size: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_positions: int,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
    dropout: float = 0.0,
) -> GPT2Config:
    """A GPT-2 config with the tokenizer's special ids and one dropout rate everywhere.

    ``dropout`` defaults to 0.0: PPO recomputes log-probs of sampled tokens and compares them with the
    rollout's, and dropout noise would make the ratio differ from 1 before any update.
    """
    if n_embd % n_head != 0:
        raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
    if len({pad_token_id, bos_token_id, eos_token_id}) != 3:
        raise ValueError(
            f"pad/bos/eos ids must be distinct, got {pad_token_id}/{bos_token_id}/{eos_token_id}; "
            "the GPT built here keeps them apart"
        )
    return GPT2Config(
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )


def config_for_tokenizer(
    tokenizer: PreTrainedTokenizerBase, size: ModelSize | str, dropout: float = 0.0
) -> GPT2Config:
    """``tiny_gpt_config`` sized by a preset (or ``ModelSize``) with ids and vocabulary from ``tokenizer``."""
    check_special_tokens(tokenizer)
    shape = model_size(size) if isinstance(size, str) else size
    return tiny_gpt_config(
        vocab_size=len(tokenizer),
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        n_positions=shape.n_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dropout=dropout,
    )


def build_causal_lm(config: GPT2Config, seed: int | None = None) -> GPT2LMHeadModel:
    """A freshly initialised GPT-2 language model (the policy). ``seed`` makes the weights reproducible."""
    if seed is not None:
        torch.manual_seed(seed)
    model = fuse_activations(GPT2LMHeadModel(config))
    # generate() reads its stop and pad ids from here; keep them in step with the tokenizer's.
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model


def build_reward_model(config: GPT2Config, seed: int | None = None) -> GPT2ForSequenceClassification:
    """A GPT-2 with a scalar head (``num_labels=1``) read at the last non-pad token (the reward model).

    ``pad_token_id`` must be set: the head finds each sequence's last real token by looking for padding.
    """
    if config.pad_token_id is None:
        raise ValueError("config.pad_token_id is None; the reward model needs it to find the last real token")
    rm_config = copy.deepcopy(config)
    rm_config.num_labels = 1
    if seed is not None:
        torch.manual_seed(seed)
    return fuse_activations(GPT2ForSequenceClassification(rm_config))


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Set the rate of every ``nn.Dropout`` in ``model`` (e.g. dropout for SFT, none for PPO)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p


@contextlib.contextmanager
def dropout_override(model: torch.nn.Module, p: float | None) -> Iterator[None]:
    """Set every dropout rate to ``p`` inside the ``with`` block (None = no change); restore them after."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    original = [m.p for m in dropouts]
    if p is not None:
        set_dropout(model, p)
    try:
        yield
    finally:
        for module, rate in zip(dropouts, original):
            module.p = rate


def count_parameters(model: PreTrainedModel) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
