"""Typed, frozen configuration for the core algorithms, one section per training kind (generation, KL, reward
shaping, LoRA, PPO, reward-model training, SFT, DPO). One docstring per field.

Defaults follow the consensus of TRL 1.12 / OpenRLHF / verl where they agree (see docs/formulas.md). The PPO
section and its parts are in ``config/ppo.py``, the supervised trainings' in ``config/training.py``, and what both
use in ``config/shared.py``; import every section from here.
"""

from rlhf_core.config.ppo import GenerationConfig, KLConfig, PPOConfig, RewardShapingConfig
from rlhf_core.config.shared import Autocast, LoRAConfig, OptimizerConfig
from rlhf_core.config.training import DPOConfig, RewardTrainingConfig, SFTConfig

__all__ = ["Autocast", "DPOConfig", "GenerationConfig", "KLConfig", "LoRAConfig", "OptimizerConfig", "PPOConfig",
           "RewardShapingConfig", "RewardTrainingConfig", "SFTConfig"]
