"""The sections of the supervised trainings: reward-model training (Bradley-Terry), SFT and DPO / IPO."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rlhf_core.config.shared import Autocast, LoRAConfig, OptimizerConfig
from rlhf_core.ranges import Count, NonNegative, Positive, PositiveInt, Range, check_ranges


@dataclass(frozen=True)
class RewardTrainingConfig(OptimizerConfig):
    """Bradley-Terry reward-model training."""

    epochs: PositiveInt = 1
    """Passes over the training pairs."""
    batch_size: PositiveInt = 16
    """Pairs per optimizer step."""
    micro_batch_size: PositiveInt | None = None
    """Pairs per forward/backward (2 sequences each), in training and evaluation; None = the whole batch. A memory
    knob only: gradients accumulate over the micro-batches, so the loss and the update are the whole batch's."""
    max_tokens_per_forward: PositiveInt | None = None
    """Most tokens in one forward/backward, in training and evaluation: at most micro_batch_size pairs, fewer while
    they are long (padded rows x longest, or the real tokens where the forward packs them; rlhf_core/models/budget.py).
    None = rows only. A memory knob only, like micro_batch_size. At least 2 x max_length: a pair is one forward."""
    learning_rate: NonNegative = 1e-4
    """Peak AdamW learning rate; 0 = score and report without updating (held-out measurements of a given model)."""
    max_length: Annotated[int, Range(ge=2, note="a prompt and a reply token")] = 256
    """Tokens per prompt+response; longer inputs keep the end (where the reply is) and are counted."""
    use_margin: bool = False
    """Subtract the per-pair `margin` column inside the sigmoid (Llama-2 style)."""
    center_rewards_coef: NonNegative | None = None
    """If set, add coef * mean((s_chosen + s_rejected)^2) to keep scores centred (TRL option)."""
    gradient_checkpointing: bool = False
    """Recompute block activations in the backward pass instead of storing them (same gradients, less memory)."""
    autocast: Autocast = "none"
    """'bf16': training and evaluation forwards under bf16 autocast; 'none': the weights' own precision."""
    seed: Count = 0
    """Seed for shuffling and head initialisation."""
    select_best_epoch: bool = False
    """Score the eval pairs before training and after every epoch and keep the weights with the lowest eval loss
    (early stopping; the weights before training count, so extra epochs can only be undone). Costs one copy
    of the weights in CPU memory; one process only. The eval pairs then choose the model: measure it elsewhere."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Train a LoRA adapter and the score head instead of every weight; the adapter is merged into the weights
    when training ends, so the result is a plain sequence classifier."""

    def __post_init__(self) -> None:
        check_ranges(self, "reward_model.training")
        if self.micro_batch_size is not None and self.micro_batch_size > self.batch_size:
            raise ValueError(f"reward_model.training.micro_batch_size={self.micro_batch_size} must be <= batch_size="
                             f"{self.batch_size} (pairs per optimizer step)")
        if self.max_tokens_per_forward is not None and self.max_tokens_per_forward < 2 * self.max_length:
            raise ValueError(f"reward_model.training.max_tokens_per_forward={self.max_tokens_per_forward} is below "
                             f"2 x max_length={2 * self.max_length}, what one pair (both sides, one forward) can need; "
                             "raise it or lower max_length")


@dataclass(frozen=True)
class SFTConfig(OptimizerConfig):
    """Hyperparameters of supervised fine-tuning."""

    epochs: PositiveInt = 3
    """Passes over the training demonstrations."""
    batch_size: PositiveInt = 16
    """Demonstrations per optimizer step."""
    micro_batch_size: PositiveInt = 16
    """Demonstrations per forward/backward; gradients add up to ``batch_size`` (same step, less memory)."""
    learning_rate: Positive = 5e-4
    """Peak AdamW learning rate (small models from scratch like 1e-3; pretrained ones 1e-5..5e-5)."""
    lr_schedule: Literal["constant", "linear"] = "linear"
    """After warm-up: keep ``learning_rate`` or decay it linearly towards 0 at the last step (the default here: a
    decay to 0 over a fixed number of epochs, as TRL's SFT does)."""
    max_length: Annotated[int, Range(ge=2, note="a prompt token and eos")] = 128
    """Longest prompt + reply + eos in tokens; longer rows keep the prompt's end and the reply's start."""
    eval_every: Annotated[int, Range(ge=0, note="0 = only before and after training")] = 50
    """Evaluate the held-out loss every this many steps (0 = only before and after training)."""
    eval_batch_size: PositiveInt = 64
    """Demonstrations per forward pass during evaluation."""
    log_every: Annotated[int, Range(ge=0, note="0 = never")] = 20
    """Write a progress line (loss, rate, ETA) to the module logger every this many steps (0 = never)."""
    seed: Count = 0
    """Seeds the shuffling and the dropout masks."""
    dropout: Annotated[float, Range(ge=0, lt=1)] | None = None
    """Dropout rate during SFT (None = keep the model's); the model's own rates are restored afterwards."""

    def __post_init__(self) -> None:
        check_ranges(self, "sft")
        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"sft.micro_batch_size={self.micro_batch_size} must be <= sft.batch_size")


@dataclass(frozen=True)
class DPOConfig(OptimizerConfig):
    """Hyperparameters of DPO / IPO."""

    beta: Positive = 0.1
    """Strength of the implicit leash to the reference: the smaller, the further the policy may move (TRL 0.1).
    For IPO the regulariser tau: the target log-ratio difference is 1 / (2 beta)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """'sigmoid': DPO's -log sigmoid(beta h); 'ipo': IPO's squared loss (h - 1/(2 beta))^2."""
    ipo_per_token: bool = True
    """IPO only: divide each reply's log-ratio by its token count before the difference (TRL's IPO, the form the
    IPO authors report); False = the summed log-probs of the paper's Eq. 17, whose target ignores reply length."""
    epochs: PositiveInt = 1
    """Passes over the training pairs."""
    batch_size: PositiveInt = 32
    """Pairs per optimizer step; the loss is their mean."""
    micro_batch_size: PositiveInt = 32
    """Pairs per forward/backward (both replies of a pair go in one forward); a memory knob, never the update."""
    learning_rate: Positive = 1e-6
    """Peak AdamW learning rate (TRL 1e-6 for pretrained models; a small model trained from scratch takes ~1e-4)."""
    lr_schedule: Literal["constant", "linear"] = "linear"
    """After warm-up: keep ``learning_rate`` or decay it linearly towards 0 at the last step (TRL's DPO default)."""
    max_length: Annotated[int, Range(ge=2, note="a prompt token and eos")] = 128
    """Longest prompt + reply + eos in tokens; longer ones keep the prompt's end and the reply's start (as SFT)."""
    eval_every: Annotated[int, Range(ge=0, note="0 = only before and after training")] = 0
    """Measure the held-out pairs every this many steps (0 = only before and after training)."""
    eval_batch_size: PositiveInt = 64
    """Pairs per forward pass when log-probs are only measured (the reference's, evaluations)."""
    log_every: Annotated[int, Range(ge=0, note="0 = never")] = 20
    """Write a progress line (loss, reward accuracy, rate, ETA) every this many steps (0 = never)."""
    seed: Count = 0
    """Seeds the order of the pairs."""

    def __post_init__(self) -> None:
        check_ranges(self, "dpo")
        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"dpo.micro_batch_size={self.micro_batch_size} must be <= dpo.batch_size="
                             f"{self.batch_size}")
