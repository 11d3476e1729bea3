"""LoRA adapters: several PPO roles on one copy of the frozen base weights. The only module that imports peft.

- policy + reference: the policy is the SFT model with a LoRA adapter; the reference is the same model with
  the adapter disabled (:class:`AdapterDisabled`, peft's ``disable_adapter()``), so the SFT weights exist once.
- reward model + critic: :class:`LoRACritic` is a LoRA adapter on the reward model's backbone plus a copy of
  its score head. Its backbone is a second module tree over the *same* weight tensors with the adapter
  injected into that tree only, so the scorer keeps running the untouched reward model.
- reward-model training: :func:`add_training_adapter` before training, :func:`merge_adapter` after it, in place.
- saving: :func:`plain_model` folds the adapter into a copy of the weights: a plain Hugging Face model.

The adapter starts with ``B = 0``: at step 0 the LoRA policy equals the reference exactly.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from rlhf_core.config import LoRAConfig
from rlhf_core.models.roles import disable_dropout, keep_in_float32, score_head, split_classifier
from rlhf_core.models.sequences import positions_from_mask

_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Every linear layer of the transformer blocks (QLoRA found adapting all of them matches full fine-tuning
#: best); the embeddings and the output layer stay frozen. Other model types fall back to peft's 'all-linear'.
DEFAULT_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    # Encoders (reward models): attention projections and every "dense" (attention output, feed-forward, pooler).
    "bert": ("query", "key", "value", "dense"),
    "roberta": ("query", "key", "value", "dense"),
    "distilbert": ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"),
}


def target_modules(model: nn.Module, config: LoRAConfig) -> list[str] | str:
    """The configured layer names, or the default for the model's type (peft's 'all-linear' when unknown)."""
    if config.target_modules:
        return list(config.target_modules)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return list(DEFAULT_TARGET_MODULES.get(model_type, ())) or "all-linear"


def adaptable_layers(model: nn.Module) -> list[str]:
    """Distinct names of the linear layers a LoRA adapter can target (for error messages)."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    return sorted(names)


def add_adapter(model: nn.Module, config: LoRAConfig, seed: int = 0, exclude: tuple[str, ...] = ()) -> PeftModel:
    """Inject a fresh LoRA adapter into ``model`` in place and freeze every other weight.

    Calling ``model`` itself afterwards runs the adapter too; the returned :class:`PeftModel` is the handle
    that disables or merges it. ``A`` is drawn from its own generator seeded with ``seed`` (not the global
    RNG), so a rerun whose earlier stages came from cache builds the same adapter; ``B`` is 0. ``exclude``
    names layers never adapted (a classifier head that trains in full). ``A`` and ``B`` are float32 whatever the
    base weights' dtype (peft's ``autocast_adapter_dtype``; see ``roles.keep_in_float32`` for why).
    """
    targets = target_modules(model, config)
    peft_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        # GPT-2 stores its linear layers as Conv1D with (in, out) weights.
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        bias="none",
        exclude_modules=list(exclude) or None,
    )
    try:
        with torch.random.fork_rng(devices=[]):  # peft draws A from the global RNG; keep that untouched
            wrapped = get_peft_model(model, peft_config, autocast_adapter_dtype=True)
    except ValueError as err:
        raise ValueError(
            f"lora.target_modules={targets} fit no layer of {type(model).__name__} ({err}); choose from its "
            f"linear layers: {', '.join(adaptable_layers(model))}"
        ) from err
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(wrapped):
            for name in layer.active_adapters:
                _reset(layer, name, generator)
    return wrapped


def lora_layers(model: nn.Module) -> Iterator[LoraLayer]:
    """Every module of ``model`` that carries a LoRA adapter."""
    return (m for m in model.modules() if isinstance(m, LoraLayer))


def _reset(layer: LoraLayer, adapter: str, generator: torch.Generator) -> None:
    """A fresh adapter: ``A`` as nn.Linear initialises its weight (LoRA paper), ``B = 0``. ``A`` is drawn on the
    CPU, where the seeded generator lives, and copied to the layer's device: the same adapter on any device."""
    weight = layer.lora_A[adapter].weight
    fresh = torch.empty(weight.shape, dtype=weight.dtype)
    nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
    weight.copy_(fresh)
    nn.init.zeros_(layer.lora_B[adapter].weight)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that receive gradients (the adapter and any head)."""
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------- policy


class AdapterDisabled(nn.Module):
    """The reference policy: the LoRA policy run with its adapter disabled, i.e. the frozen SFT weights.

    It owns no parameters (the policy is held outside the module tree), so nothing can freeze, move or
    checkpoint the policy's adapter through it. Forward passes run without gradients.
    """

    def __init__(self, policy: PeftModel) -> None:
        super().__init__()
        self._policy = (policy,)  # a tuple, not a submodule: the reference must not own the adapter

    @property
    def policy(self) -> PeftModel:
        """The LoRA policy whose base weights this reference runs."""
        return self._policy[0]

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003 - same signature as the wrapped model
        """The base model's forward (same arguments and outputs as the policy's)."""
        with self._adapter_off():
            return self.policy(*args, **kwargs)

    def runs_under(self) -> tuple[PeftModel, contextlib.AbstractContextManager]:
        """(the policy, a context in which it computes this reference's outputs): lets
        :func:`rlhf_core.models.roles.policy_forward` take the same (head-only) path for the reference as for the
        policy."""
        return self.policy, self._adapter_off()

    @contextlib.contextmanager
    def _adapter_off(self) -> Iterator[None]:
        with torch.no_grad(), self.policy.disable_adapter():
            yield

    @torch.no_grad()
    def refresh(self, optimizer: torch.optim.Optimizer | None = None, seed: int = 0) -> None:
        """Move the reference to the current policy: merge the adapter into the shared base weights and restart
        it (fresh ``A`` from ``seed``, ``B = 0``, its optimizer moments cleared). The policy's outputs do not
        change; the reference's become the policy's (up to float rounding of the merge)."""
        generator = torch.Generator().manual_seed(seed)
        for layer in lora_layers(self.policy):
            for name in layer.active_adapters:
                base = layer.get_base_layer()
                base.weight += layer.get_delta_weight(name).to(base.weight.dtype)
                _reset(layer, name, generator)
                if optimizer is not None:
                    for p in (layer.lora_A[name].weight, layer.lora_B[name].weight):
                        optimizer.state.pop(p, None)


def lora_policy(policy: PreTrainedModel, config: LoRAConfig, seed: int = 0) -> tuple[PeftModel, AdapterDisabled]:
    """(LoRA policy, reference = the same weights with the adapter disabled). Dropout off in both."""
    wrapped = add_adapter(disable_dropout(policy), config, seed)
    return wrapped, AdapterDisabled(wrapped)


# --------------------------------------------------------------------------------------------- critic


def shared_weights_copy(module: nn.Module) -> nn.Module:
    """A new module tree whose parameters and buffers are the *same tensors* as ``module``'s (no copies).

    Injecting an adapter into the copy leaves ``module``'s tree, and everything that runs it, unchanged.
    """
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


class LoRACritic(nn.Module):
    """Value model = the reward model + a LoRA adapter on its backbone + a trainable copy of its score head.

    The reward model's weights are shared with the scorer (one frozen copy); only the adapter and the head
    (hidden_size + 1 numbers) train, both in float32 whatever the reward model's dtype. Same call signature as
    :class:`rlhf_core.models.roles.Critic`.
    """

    def __init__(self, reward_model: PreTrainedModel, config: LoRAConfig, seed: int = 0) -> None:
        super().__init__()
        backbone, head = split_classifier(reward_model)
        reward_model.requires_grad_(False)
        self.backbone = add_adapter(disable_dropout(shared_weights_copy(backbone)), config, seed)
        self.head = keep_in_float32(copy.deepcopy(head)).requires_grad_(True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T), (B, T) -> per-token values (B, T)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask)
        ).last_hidden_state  # (B, T, H)
        return self.head(hidden).squeeze(-1).float()  # the head casts its input (keep_in_float32)


# --------------------------------------------------------------------------------------------- training, saving


def add_training_adapter(model: PreTrainedModel, config: LoRAConfig, seed: int = 0) -> PeftModel:
    """Reward-model training: an adapter on ``model`` (in place) with the score head fully trainable (the caller
    holds it in float32: ``reward_training.train_reward_model``)."""
    heads = score_head(model)
    inside = {id(m) for head in heads for m in head.modules()}
    head_names = [name for name, module in model.named_modules() if id(module) in inside]
    wrapped = add_adapter(model, config, seed, exclude=tuple(head_names))
    for head in heads:
        head.requires_grad_(True)
    return wrapped


def merge_adapter(wrapped: PeftModel) -> PreTrainedModel:
    """Fold the adapter into the weights in place and remove it; every weight is trainable again.

    Returns the plain model, the very object that was wrapped.
    """
    plain = wrapped.merge_and_unload()
    plain.requires_grad_(True)
    return plain


def plain_model(model: nn.Module) -> nn.Module:
    """``model`` itself, or for a LoRA model a merged copy (a plain Hugging Face model that ``from_pretrained``
    loads unchanged); the live model and its adapter are left as they are."""
    if not isinstance(model, PeftModel):
        return model
    return copy.deepcopy(model).merge_and_unload()
