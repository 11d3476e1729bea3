"""What kind of Hugging Face model a checkpoint is, read from the model itself: whether its attention is causal, where
its sequence classifier reads the score, and which of its modules are the classification head.

Used wherever behaviour depends on the family rather than on a class name:

- a policy must be a causal LM (a token may see only earlier tokens) - an encoder loaded through
  ``AutoModelForCausalLM`` (``BertLMHeadModel``) would train a "policy" that sees the future;
- packing several sequences into one row keeps them apart only under causal attention;
- a decoder reward model scores at its last real token with a per-token linear ``score`` head (which is also what
  lets it serve as a per-token critic); an encoder reads its pooled / first token through its own head, and its
  input starts with the tokenizer's ``[CLS]`` (:func:`score_prefix`).

Causality comes from the attention modules' ``is_causal`` flags (transformers sets them from the architecture and
the config: BERT's is ``config.is_decoder``); a model without any is probed (:func:`probe_causal`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: A probe's sequence length and batch: two rows that agree on the first half and differ on the second.
PROBE_LENGTH = 8


def inner_model(model: nn.Module) -> PreTrainedModel | None:
    """The transformers model inside ``model`` (itself, or the one a PEFT / DeepSpeed / critic wrapper holds)."""
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _attention_flags(model: nn.Module) -> Iterator[bool]:
    for module in model.modules():
        flag = getattr(module, "is_causal", None)
        if isinstance(flag, bool) and "attention" in type(module).__name__.lower():
            yield flag


def attention_is_causal(model: nn.Module) -> bool | None:
    """True when every attention module of ``model`` is causal, False when one is not, None when none says
    (then only :func:`probe_causal` can tell). Works on a model built on the meta device (no weights read)."""
    flags = list(_attention_flags(model))
    if not flags:
        return None
    return all(flags)


@torch.no_grad()
def probe_causal(model: nn.Module) -> bool:
    """Whether the outputs at a position ignore every later token, measured: two sequences equal on their first
    half and different after it must give the same outputs on the first half. One forward of 2 x 8 tokens."""
    inner = inner_model(model) or model
    vocab = int(getattr(inner.config, "vocab_size", 2))
    device = next(inner.parameters()).device
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(0, vocab, (1, PROBE_LENGTH), generator=generator)
    second = first.clone()
    second[0, PROBE_LENGTH // 2:] = (first[0, PROBE_LENGTH // 2:] + 1) % vocab
    ids = torch.cat([first, second]).to(device)
    backbone = getattr(inner, getattr(inner, "base_model_prefix", ""), None) or inner  # a head may need a pad id
    was_training = inner.training
    inner.eval()
    try:
        out = backbone(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    finally:
        inner.train(was_training)
    hidden = out.hidden_states[-1][:, : PROBE_LENGTH // 2].float()
    return bool(torch.allclose(hidden[0], hidden[1], atol=1e-5, rtol=1e-4))


def is_causal(model: nn.Module) -> bool:
    """:func:`attention_is_causal`, or the :func:`probe_causal` measurement when the modules do not say."""
    inner = inner_model(model) or model
    flag = attention_is_causal(inner)
    return probe_causal(inner) if flag is None else flag


def per_token_head(model: nn.Module) -> nn.Linear | None:
    """The linear ``score`` head of a causal sequence classifier (GPT-2, Llama, Mistral, Qwen, GPT-NeoX ...): it maps
    every position's hidden state to a score, read at the last real token. None for other heads (encoders' pooled
    heads, RoBERTa's dense + projection on ``<s>``) and for bidirectional models."""
    inner = inner_model(model)
    head = getattr(inner, "score", None) if inner is not None else None
    if not isinstance(head, nn.Linear) or getattr(inner, inner.base_model_prefix, None) is None:
        return None
    return head if attention_is_causal(inner) is not False else None


def reads_last_token(model: nn.Module) -> bool:
    """True when the reward model's score is read at each row's last real token (a causal model with a per-token
    head); False when the architecture reads its own pooled / first token (an encoder)."""
    return per_token_head(model) is not None


def head_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The classification head of a sequence classifier: its top-level modules with weights other than the backbone
    (``score``; ``classifier``; DistilBERT's ``pre_classifier`` and ``classifier``), as (name, module)."""
    inner = inner_model(model)
    if inner is None:
        return []
    backbone = getattr(inner, inner.base_model_prefix, None)
    return [(name, child) for name, child in inner.named_children()
            if child is not backbone and any(True for _ in child.parameters())]


def score_prefix(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids a reward model's input starts with: none for a last-token reader, the tokenizer's bos (``[CLS]``) for an
    encoder, whose head reads the first position."""
    if reads_last_token(model):
        return []
    token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    if token_id is None:
        raise ValueError(f"{describe(model)} reads its first token, but tokenizer {tokenizer.name_or_path!r} has "
                         "no bos or cls token to put there; set reward_model.tokens.bos")
    return [int(token_id)]


def max_positions(model: nn.Module) -> int | None:
    """Longest sequence the model takes (:func:`config_positions` of its config)."""
    return config_positions(getattr(inner_model(model) or model, "config", None))


def config_positions(config: object) -> int | None:
    """Longest sequence a model config allows (``n_positions`` for GPT-2, ``max_position_embeddings`` otherwise);
    None when it names none (rotary models without a limit)."""
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return int(positions) if isinstance(positions, int) else None


def describe(model: nn.Module) -> str:
    """One phrase for messages: the class name and whether it is a decoder or an encoder."""
    inner = inner_model(model) or model
    kind = "decoder" if attention_is_causal(inner) is not False else "bidirectional encoder"
    return f"{type(inner).__name__} ({kind})"
