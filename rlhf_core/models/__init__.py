"""Models and text: building, loading and running the PPO roles, and turning text into token ids.

- ``roles``: policy, frozen reference, reward model, value model (``ValueHead`` / ``Critic``) and their forwards.
- ``families``: what kind of checkpoint a model is (causal or not, where its score is read, its head), from the model.
- ``lm``: small GPT-2 models built from a config (no downloads).
- ``lm_head``: the output layer applied at chosen positions only.
- ``lora``: LoRA adapters sharing one copy of the frozen base weights (the only module that imports peft).
- ``packing``: padding-free forwards over the rollout layout.
- ``memory``: bf16 autocast and gradient checkpointing.
- ``offload``: frozen networks held in host memory while trained ones train (``ppo.offload_frozen``).
- ``tokenizer``: a small byte-level BPE tokenizer trained on the task's text.
- ``text``: (prompt, response) text -> token ids, the same way for the policy, the reward model and SFT.
- ``scoring``: reward sources (reward model, rule functions, weighted sums).

The names below are re-exported for "PPO in a few lines"; code inside ``rlhf_core`` imports from the modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_core.models.roles import Critic, ValueHead, load_policy, load_reward_model, make_reference
    from rlhf_core.models.scoring import RewardModelScorer

#: Public name -> the module that defines it. Loaded on first use: importing the modules here would run
#: ``roles -> packing -> training.rollout -> training -> models.roles`` while roles is half-initialised.
_EXPORTS = {
    "load_policy": "rlhf_core.models.roles",
    "load_reward_model": "rlhf_core.models.roles",
    "make_reference": "rlhf_core.models.roles",
    "ValueHead": "rlhf_core.models.roles",
    "Critic": "rlhf_core.models.roles",
    "RewardModelScorer": "rlhf_core.models.scoring",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
