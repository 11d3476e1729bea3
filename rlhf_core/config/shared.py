"""What more than one training kind shares: the precision of training forwards and the LoRA adapter settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from rlhf_core.ranges import Positive, PositiveInt, Range, check_ranges

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
