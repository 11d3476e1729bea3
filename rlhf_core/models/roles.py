"""The four PPO roles and the forward passes over ``[query | response]`` batches.

- policy: ``AutoModelForCausalLM`` whose attention is causal (trainable); reference: a frozen copy of it;
- reward model: ``AutoModelForSequenceClassification(num_labels=1)``, decoder or encoder: a decoder's score is read
  at the last real token, an encoder's where its architecture reads it (its pooled / first token;
  ``families.reads_last_token``);
- value model: a linear head on the policy's last hidden state, or a separate critic initialised from
  a decoder reward model (its backbone and its score head, applied at every token).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

from rlhf_core.models.families import describe, head_modules, is_causal, per_token_head, reads_last_token
from rlhf_core.models.lm_head import split_lm_head
from rlhf_core.models.packing import padded_forward
from rlhf_core.ppo.masking import entropy_from_logits, last_token_index, logprobs_from_logits


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0 (rollouts, scoring and updates all run without dropout)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def fuse_activations(model: nn.Module) -> nn.Module:
    """Swap Python-level tanh-GELUs (GPT-2's ``gelu_new``, ``gelu_fast``) for torch's fused kernel, in place.

    ``NewGELUActivation`` / ``FastGELUActivation`` compute ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    as five separate elementwise ops (each with its own backward), a sixth of a small GPT-2's PPO update on
    CPU; ``F.gelu(approximate="tanh")`` is the same function in one kernel (equal within float rounding).
    The saved config is unchanged: a checkpoint written after this still loads as the original model.
    """
    from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in (NewGELUActivation, FastGELUActivation):
                setattr(module, name, GELUTanh())
    return model


def keep_in_float32(module: nn.Module) -> nn.Module:
    """Hold ``module``'s weights in float32, in place, whatever dtype the model around it was loaded in.

    For what trains on a half-precision base: value and score heads (LoRA's A and B are upcast by peft,
    ``lora.add_adapter``). bf16 keeps 8 significant bits, so an Adam step of ~lr = 5e-5 on a weight with
    |w| >= 2^-6 is under half the spacing between bf16 numbers there and rounds away: the head never moves.
    Its inputs are cast to its weights' dtype on the way in (a forward pre-hook, so callers and an encoder's own
    classification forward need not); under bf16 autocast the matmul still runs in bf16, and only the stored weight
    (and so the update) keeps full precision. A head partitioned by ZeRO-3 as it loaded (its parameters carry
    DeepSpeed's ``ds_id`` and hold only this rank's shard) is not cast: its engine decides the stored dtype (the bf16
    mode keeps fp32 master weights).
    """
    if not any(hasattr(p, "ds_id") for p in module.parameters()):
        module.float()
    if not getattr(module, "_casts_inputs", False):
        module.register_forward_pre_hook(_inputs_to_weight_dtype)
        module._casts_inputs = True
    return module


def _inputs_to_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    return tuple(a.to(dtype) if dtype is not None and isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def as_input_of(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the dtype of ``head``'s weight, for a head that may not be held by :func:`keep_in_float32`
    (a loaded reward model's, whose backbone may return another dtype)."""
    return hidden.to(head.weight.dtype)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no gradients, no dropout: for the reference and reward models."""
    model.eval()
    model.requires_grad_(False)
    return disable_dropout(model)


def load_policy(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM (Hugging Face id or local directory) with dropout off; refuse one whose attention is not
    causal (:func:`check_causal_lm`)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except ValueError as err:  # no causal-LM class for this config (an encoder-only family)
        raise ValueError(f"{path}: a policy must be a causal LM (GPT-2, Llama, Qwen, ...); "
                         f"{str(err).splitlines()[0]}") from None
    return fuse_activations(disable_dropout(check_causal_lm(model, path)))


def check_causal_lm(model: PreTrainedModel, source: str) -> PreTrainedModel:
    """``model``, or ValueError in one line when its attention lets a token see later tokens (an encoder loaded as
    an LM head, e.g. ``BertLMHeadModel`` without ``is_decoder``): such a "policy" would learn from the future."""
    if not is_causal(model):
        raise ValueError(f"{source}: {describe(model)} attends to later tokens; a policy must be a causal LM "
                         "(GPT-2, Llama, Qwen, ...): use an encoder as a reward model (reward_model.init) instead")
    return model


def make_reference(policy: nn.Module) -> nn.Module:
    """A frozen deep copy of the policy."""
    return freeze(copy.deepcopy(policy))


def load_reward_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a trained reward model (a 1-output sequence classifier, decoder or encoder) and check it has one output."""
    model = fuse_activations(AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype))
    if model.config.num_labels != 1:
        raise ValueError(
            f"reward model at {path} has num_labels={model.config.num_labels}; a reward model needs "
            "num_labels=1 (one scalar score per sequence); start training from it with reward_model.init instead"
        )
    return model


def init_reward_model(path: str, seed: int, dtype: torch.dtype = torch.float32,
                      pad_token_id: int | None = None) -> tuple[PreTrainedModel, bool]:
    """The starting point of reward-model training from any checkpoint: ``(model, fresh_head)``.

    A 1-output sequence classifier is continued as it is; anything else (a base model, a causal LM, a classifier
    with another number of labels) loads its backbone under a fresh scalar head drawn after
    ``torch.manual_seed(seed)``, so the two reward models of a run start apart and a rerun starts the same.
    """
    config = AutoConfig.from_pretrained(path)
    classifier = any(name.endswith("ForSequenceClassification") for name in (config.architectures or []))
    extra = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    torch.manual_seed(seed)
    if classifier and config.num_labels == 1:
        return fuse_activations(AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, **extra)), False
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, ignore_mismatched_sizes=classifier, **extra)
    except ValueError as err:  # no sequence-classification class for this config
        raise ValueError(f"{path}: cannot be a reward model ({str(err).splitlines()[0]})") from None
    return fuse_activations(model), True


def split_classifier(model: PreTrainedModel) -> tuple[nn.Module, nn.Linear]:
    """The backbone and the per-token linear score head of a decoder sequence classifier (GPT-2 / Llama / Mistral /
    Qwen / GPT-NeoX style), for a critic that scores every position.

    An encoder's head reads its pooled / first token and has no per-token meaning; the error says so.
    """
    head = per_token_head(model)
    backbone = getattr(model, model.base_model_prefix, None)
    if backbone is None or head is None:
        raise ValueError(
            f"{describe(model)} has no per-token linear 'score' head (its score is read from one position), so it "
            "cannot be a critic; use ppo.value_model='head', or a decoder reward model (GPT-2, Llama, Qwen, ...)"
        )
    return backbone, head


def token_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Score head applied at every position of a sequence classifier. (B, T), (B, T) -> (B, T)."""
    backbone, head = split_classifier(model)
    hidden = padded_forward(backbone, input_ids, attention_mask).last_hidden_state  # (B, T, H), padding skipped
    return head(as_input_of(head, hidden)).squeeze(-1).float()


def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each row. (B, T), (B, T) -> (B,).

    A decoder's is read at the LAST REAL token (for left, right or mixed padding: the index comes from the attention
    mask, not from searching for pad ids, which breaks when pad == eos); the forward is padding-free. An encoder's
    comes from its own classification forward (its pooled / first token: rows must start with the tokenizer's
    ``[CLS]``, ``families.score_prefix``, and be right padded).
    """
    if not reads_last_token(model):
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
    per_token = token_scores(model, input_ids, attention_mask)
    last = last_token_index(attention_mask.bool())
    return per_token.gather(1, last.unsqueeze(1)).squeeze(1)


def score_head(model: PreTrainedModel) -> list[nn.Module]:
    """The modules of a reward model's classification head (trained in full, held in float32)."""
    modules = [module for _, module in head_modules(model)]
    if not modules:
        raise ValueError(f"{describe(model)} has no classification head to train")
    return modules


class ValueHead(nn.Module):
    """A linear value head on the policy's last hidden state, initialised near zero, in float32 whatever the
    policy's dtype (:func:`keep_in_float32`; move it with ``.to(device)``, not ``.to(dtype)``).

    The initial weights come from their own seeded generator, not the global RNG: a resumed pipeline whose
    earlier stages came from cache (and so consumed no random numbers) must build the same head.
    """

    def __init__(self, hidden_size: int, seed: int = 0) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            std = 0.01 / (hidden_size + 1) ** 0.5
            self.summary.weight.copy_(torch.randn(self.summary.weight.shape, generator=generator) * std)
            self.summary.bias.zero_()
        keep_in_float32(self.summary)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T)."""
        return self.summary(hidden).squeeze(-1).float()


class Critic(nn.Module):
    """A separate value model: a reward model's backbone and score head, applied at every token.

    The whole copy trains; its score head is held in float32 (:func:`keep_in_float32`), the backbone in the
    reward model's dtype.
    """

    def __init__(self, reward_model: PreTrainedModel, copy_weights: bool = True) -> None:
        """``copy_weights=False``: ``reward_model`` is the critic's own (loaded for it, e.g. partitioned by ZeRO-3 as
        it loaded, which a deep copy would not keep apart), not the scorer's."""
        super().__init__()
        self.model = disable_dropout(copy.deepcopy(reward_model) if copy_weights else reward_model)
        self.model.requires_grad_(True)
        keep_in_float32(split_classifier(self.model)[1])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T), (B, T) -> per-token values (B, T)."""
        return token_scores(self.model, input_ids, attention_mask)


@dataclass
class PolicyOutput:
    """Forward-pass results on the response span. All (B, Tr)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None


def response_slice(full: torch.Tensor, query_len: int) -> torch.Tensor:
    """Positions whose outputs predict the response tokens: ``[Tq - 1, T - 1)``. (B, T, ...) -> (B, Tr, ...)."""
    return full[:, query_len - 1 : -1]


def policy_forward(
    policy: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    query_len: int,
    temperature: float,
    value_head: ValueHead | None = None,
    with_entropy: bool = False,
) -> PolicyOutput:
    """Log-probs of the response tokens (temperature applied), optional entropy and head values.

    input_ids, attention_mask: (B, Tq + Tr); the response is ``input_ids[:, query_len:]``. A module that runs
    another model under a context (``runs_under()``, the LoRA reference) is computed as that model in it.
    """
    runs_under = getattr(policy, "runs_under", None)
    if callable(runs_under):
        model, context = runs_under()
        with context:
            return policy_forward(model, input_ids, attention_mask, query_len, temperature, value_head, with_entropy)
    tokens = input_ids[:, query_len:]
    split = split_lm_head(policy)
    if split is None:
        out = padded_forward(policy, input_ids, attention_mask, output_hidden_states=value_head is not None)
        logits = response_slice(out.logits, query_len)  # (B, Tr, V)
        logprobs = logprobs_from_logits(logits, tokens, temperature)
        entropy = entropy_from_logits(logits, temperature) if with_entropy else None
        hidden = response_slice(out.hidden_states[-1], query_len) if value_head is not None else None
    else:
        # The LM head (and the log-softmax over the vocabulary) only at the real response tokens: the prompt
        # and padding positions' logits are never used, and (B, T, V) logits are a rollout's largest tensor.
        backbone, head = split
        hidden = response_slice(padded_forward(backbone, input_ids, attention_mask).last_hidden_state, query_len)
        real = attention_mask[:, query_len:].bool()  # (B, Tr): the response mask
        token_logprobs, token_entropy = vocab_outputs(head, hidden[real], tokens[real], temperature, with_entropy)
        logprobs = _scatter(real, token_logprobs)
        entropy = _scatter(real, token_entropy) if with_entropy else None
    values = value_head(hidden) if value_head is not None else None
    return PolicyOutput(logprobs, entropy, values)


#: Elements of one chunk's float32 (rows, V) logits in :func:`vocab_outputs` (2^26: 256 MB); a vocabulary of 152k
#: takes 441 rows at a time, the demo's 2k all of a micro-batch at once.
VOCAB_CHUNK_ELEMENTS = 1 << 26


def vocab_outputs(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` (and entropies) under ``softmax(head(hidden) / temperature)``: (N, H), (N,) -> (N,).

    The output layer and the softmax over the vocabulary run a chunk of rows at a time, at most
    ``VOCAB_CHUNK_ELEMENTS`` logits each; while gradients are recorded each chunk is checkpointed (recomputed in
    the backward pass), so no float32 (N, V) tensor is kept whole for backward: the peak is one chunk's. The
    values and gradients are those of the whole computation.
    """
    rows = max(1, VOCAB_CHUNK_ELEMENTS // head.out_features) if hasattr(head, "out_features") else hidden.shape[0]
    if hidden.shape[0] <= rows:
        return _vocab_chunk(head, hidden, tokens, temperature, with_entropy)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = []
    for start in range(0, hidden.shape[0], rows):
        chunk = (head, hidden[start:start + rows], tokens[start:start + rows], temperature, with_entropy)
        parts.append(checkpoint(_vocab_chunk, *chunk, use_reentrant=False) if recompute else _vocab_chunk(*chunk))
    logprobs = torch.cat([lp for lp, _ in parts])
    return logprobs, (torch.cat([ent for _, ent in parts]) if with_entropy else None)


def _vocab_chunk(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head(hidden)  # (n, V)
    entropy = entropy_from_logits(logits, temperature) if with_entropy else None
    return logprobs_from_logits(logits, tokens, temperature), entropy


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(N,) values of the True entries of a (B, T) mask -> (B, T), 0 elsewhere. Differentiable."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def critic_forward(critic: Critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Critic values aligned with the response tokens. (B, Tq + Tr) -> (B, Tr)."""
    return response_slice(critic(input_ids, attention_mask).unsqueeze(-1), query_len).squeeze(-1)
