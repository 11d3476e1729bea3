"""What more than one training kind shares: the optimizer settings, the precision of training forwards and the LoRA
adapter settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from rlhf_core.ranges import ClipNorm, Count, NonNegative, Positive, PositiveInt, Range, check_ranges

Autocast = Literal["none", "bf16"]
"""Precision of training forwards: the weights' own ('none') or bf16 autocast (rlhf_core/models/memory.py)."""


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (rlhf_core/models/lora.py) instead of full fine-tuning: one frozen copy of the base weights."""

    enabled: bool = False
    """Train a LoRA adapter (and the heads) instead of every weight."""
    rank: PositiveInt = 8
    """r: rank of the learned update ``B @ A``."""
    alpha: Positive = 16.0
    """The update is scaled by ``alpha / rank``."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input. Reward-model training only: PPO must run without dropout (ratio 1)."""
    target_modules: tuple[str, ...] = ()
    """Names of the linear layers to adapt; () = every linear layer of the blocks (GPT-2: c_attn, c_proj,
    c_fc; Llama/Mistral/Qwen2: q/k/v/o_proj, gate/up/down_proj; other models: peft's 'all-linear')."""

    def __post_init__(self) -> None:
        check_ranges(self, "lora")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule: the settings every training section shares (``sft``, ``dpo``,
    ``reward_model.training``, ``ppo``), each stepped through one strategy (rlhf_core/training/strategy.py). A
    section whose default differs declares that field again, with the reason."""

    learning_rate: Positive = 1e-5
    """Peak AdamW learning rate (PPO: the policy's; ``ppo.value_learning_rate`` is the value model's)."""
    weight_decay: NonNegative = 0.0
    """AdamW decoupled weight decay, applied to every trained parameter."""
    warmup_steps: Count = 0
    """Optimizer steps of linear warm-up from ~0 to ``learning_rate``."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """After warm-up: keep ``learning_rate`` ('constant') or decay it linearly towards 0 at the last optimizer step
    ('linear'; PPO's last step is that of ``total_updates``)."""
    max_grad_norm: ClipNorm = 1.0
    """Clip each trained model's gradient norm to this value (inf = no clipping; the norm is still reported). TRL's
    PPO applies no clipping of its own; OpenRLHF and verl clip at 1.0."""
