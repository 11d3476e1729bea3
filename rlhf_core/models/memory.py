"""Memory savers for training forwards: bf16 autocast and gradient checkpointing.

Both are config options (``PPOConfig`` / ``RewardTrainingConfig``: ``autocast``, ``gradient_checkpointing``).
Autocast must wrap every forward whose outputs PPO compares: the old log-probs, the reference log-probs and
the training forward all run under the same precision, or the ratio on the first mini-batch is not 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
import torch
from torch import nn
from transformers import PreTrainedModel

from rlhf_core.config import Autocast


@contextlib.contextmanager
def autocast(kind: Autocast, device: torch.device) -> Iterator[None]:
    """Run the block under ``torch.autocast(bf16)`` on ``device`` ('none' = unchanged precision).

    Matmuls run in bf16 while weights, optimizer states and reductions that autocast keeps in fp32 (softmax,
    log-softmax, losses) stay fp32: the memory of activations halves, the weights' does not (that is the
    ``dtype`` setting of the pipeline).
    """
    if kind == "none":
        yield
        return
    if kind != "bf16":
        raise ValueError(f"autocast must be 'none' or 'bf16', got {kind!r}")
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        yield


def enable_gradient_checkpointing(module: nn.Module) -> None:
    """Recompute each transformer block's activations in the backward pass instead of storing them.

    Applies to every Hugging Face model inside ``module`` (the policy, a critic's reward-model backbone), with
    non-reentrant checkpointing. Hugging Face only checkpoints modules in training mode, so the module is put
    in training mode; dropout is already 0 in every PPO model (``disable_dropout``) and generation switches to
    eval mode on its own, so that changes nothing else. Idempotent.
    """
    found = False
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and sub.supports_gradient_checkpointing:
            if not is_checkpointing(sub):
                _enable(sub)
            found = True
    if not found:
        raise ValueError(
            f"{type(module).__name__} holds no Hugging Face model that supports gradient checkpointing; "
            "set gradient_checkpointing=false for it"
        )
    module.train()


def is_checkpointing(module: nn.Module) -> bool:
    """True when some layer inside ``module`` recomputes its activations in the backward pass."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def _enable(model: PreTrainedModel) -> None:
    # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias) and its kwargs.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
