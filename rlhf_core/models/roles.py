"""The four PPO roles and the forward passes over ``[query | response]`` batches.

- policy: ``AutoModelForCausalLM`` (trainable); reference: a frozen copy of it;
- reward model: ``AutoModelForSequenceClassification(num_labels=1)``, score read at the last real token;
- value model: a linear head on the policy's last hidden state, or a separate critic initialised from
  the reward model (its backbone and its score head, applied at every token).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

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
    Its forward casts its input to the weight's dtype (:func:`as_input_of`); under bf16 autocast the matmul
    still runs in bf16, and only the stored weight (and so the update) keeps full precision.
    """
    return module.float()


def as_input_of(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the dtype of ``head``'s weight: a float32 head on a bf16 backbone without autocast."""
    return hidden.to(head.weight.dtype)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no gradients, no dropout: for the reference and reward models."""
    model.eval()
    model.requires_grad_(False)
    return disable_dropout(model)


def load_policy(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM (Hugging Face id or local directory) with dropout off."""
    return fuse_activations(disable_dropout(AutoModelForCausalLM.from_pretrained(path, dtype=dtype)))


def make_reference(policy: nn.Module) -> nn.Module:
    """A frozen deep copy of the policy."""
    return freeze(copy.deepcopy(policy))


def load_reward_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a 1-label sequence classifier and check it really has one output."""
    model = fuse_activations(AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype))
    if model.config.num_labels != 1:
        raise ValueError(
            f"reward model at {path} has num_labels={model.config.num_labels}; a reward model needs "
            "num_labels=1 (one scalar score per sequence)"
        )
    return model


def split_classifier(model: PreTrainedModel) -> tuple[nn.Module, nn.Linear]:
    """The backbone and the linear score head of a sequence classifier (GPT-2/Llama/Mistral style).

    Heads that pool internally (e.g. RoBERTa's dense+proj on <s>) are not per-token and cannot serve a
    critic; the error says so.
    """
    backbone = getattr(model, model.base_model_prefix, None)
    head = getattr(model, "score", None)
    if backbone is None or not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no per-token linear 'score' head; use a decoder reward model "
            "(GPT-2, Llama, Mistral, Qwen ...) or ppo.value_model='head'"
        )
    return backbone, head


def token_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Score head applied at every position of a sequence classifier. (B, T), (B, T) -> (B, T)."""
    backbone, head = split_classifier(model)
    hidden = padded_forward(backbone, input_ids, attention_mask).last_hidden_state  # (B, T, H), padding skipped
    return head(as_input_of(head, hidden)).squeeze(-1).float()


def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score read at the LAST REAL token of each row. (B, T), (B, T) -> (B,).

    Works for left, right or mixed padding because the index comes from the attention mask, not from
    searching for pad ids (which breaks when pad == eos).
    """
    per_token = token_scores(model, input_ids, attention_mask)
    last = last_token_index(attention_mask.bool())
    return per_token.gather(1, last.unsqueeze(1)).squeeze(1)


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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T)."""
        return self.summary(as_input_of(self.summary, hidden)).squeeze(-1).float()


class Critic(nn.Module):
    """A separate value model: a reward model's backbone and score head, applied at every token.

    The whole copy trains; its score head is held in float32 (:func:`keep_in_float32`), the backbone in the
    reward model's dtype.
    """

    def __init__(self, reward_model: PreTrainedModel) -> None:
        super().__init__()
        self.model = disable_dropout(copy.deepcopy(reward_model))
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
        logits = head(hidden[real])  # (N, V)
        logprobs = _scatter(real, logprobs_from_logits(logits, tokens[real], temperature))
        entropy = _scatter(real, entropy_from_logits(logits, temperature)) if with_entropy else None
    values = value_head(hidden) if value_head is not None else None
    return PolicyOutput(logprobs, entropy, values)


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(N,) values of the True entries of a (B, T) mask -> (B, T), 0 elsewhere. Differentiable."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def critic_forward(critic: Critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Critic values aligned with the response tokens. (B, Tq + Tr) -> (B, Tr)."""
    return response_slice(critic(input_ids, attention_mask).unsqueeze(-1), query_len).squeeze(-1)
