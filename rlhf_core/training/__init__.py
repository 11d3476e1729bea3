"""Training: rollouts, experience, the PPO step and loop, reward-model training, SFT, and how updates apply.

- ``rollout``: batched sampling with a KV cache -> ``Rollout``.
- ``experience``: generate -> old / reference log-probs, values -> scores -> rewards -> GAE (``PPOModels``).
- ``ppo_step``: one PPO update (epochs x mini-batches, KL controller, optional reference refresh).
- ``ppo_loop``: ``train_ppo`` over a prompt table with checkpoints and exact resume.
- ``sampler``: the deterministic, resumable prompt order.
- ``checkpoint``: atomic, pickle-free checkpoints.
- ``checkpoint_integrity``: the manifest that seals a checkpoint, verified before a resume trusts it.
- ``reward_training``: Bradley-Terry reward-model training and evaluation.
- ``sft``: supervised fine-tuning on demonstrations.
- ``dpo``, ``dpo_losses``: DPO / IPO on preference pairs, offline (the loop, and its math as pure functions).
- ``strategy``: how losses become weight updates (one process, or data-parallel).

The names below are re-exported for "PPO in a few lines"; code inside ``rlhf_core`` imports from the modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_core.training.experience import PPOModels
    from rlhf_core.training.ppo_loop import train_ppo

#: Public name -> the module that defines it, loaded on first use (see ``rlhf_core.models``: no import cycles).
_EXPORTS = {
    "PPOModels": "rlhf_core.training.experience",
    "train_ppo": "rlhf_core.training.ppo_loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
