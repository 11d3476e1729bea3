"""The math of DPO and IPO as pure functions: sequence log-probs over reply tokens, the pair losses, implicit rewards.

Log-prob tensors of pairs are ``(B, 2)``: column 0 the chosen reply, column 1 the rejected one; ``ref_logprobs`` are
the frozen reference's. With ``h = (logp_c - ref_c) - (logp_r - ref_r)``, DPO's loss is ``-log sigmoid(beta h)``
and IPO's ``(h - 1 / (2 beta))^2``. The training loop that uses them is :mod:`rlhf_core.training.dpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf_core.ppo.pairwise import pairwise_accuracy
from rlhf_core.ppo.masking import logprobs_from_logits, masked_sum
from rlhf_core.training.sft import IGNORE_INDEX


def reply_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each row's labelled tokens (reply + eos). logits (B, T, V), labels (B, T) -> (B,).

    ``logits[:, t]`` predicts token ``t + 1``; prompt and padding positions (label ``IGNORE_INDEX``) add nothing,
    whatever their logits hold.
    """
    targets = labels[:, 1:]  # (B, T-1)
    response_mask = targets != IGNORE_INDEX  # (B, T-1)
    logprobs = logprobs_from_logits(logits[:, :-1], targets.clamp(min=0))  # (B, T-1)
    return masked_sum(logprobs, response_mask, dim=1)


def log_ratio_margin(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``h = (logp_c - ref_c) - (logp_r - ref_r)``. (B, 2), (B, 2) -> (B,)."""
    ratios = logprobs - ref_logprobs  # (B, 2)
    return ratios[:, 0] - ratios[:, 1]


def sigmoid_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO: ``-log sigmoid(beta * h)`` per pair. (B, 2), (B, 2) -> (B,)."""
    return -F.logsigmoid(beta * log_ratio_margin(logprobs, ref_logprobs))


def ipo_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
    """IPO: ``(h - 1 / (2 beta))^2`` per pair; with ``lengths`` (B, 2) each reply's log-ratio is divided by its token
    count first (TRL). (B, 2), (B, 2) -> (B,)."""
    if lengths is not None:
        logprobs, ref_logprobs = logprobs / lengths, ref_logprobs / lengths
    return (log_ratio_margin(logprobs, ref_logprobs) - 1 / (2 * beta)) ** 2


def implicit_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """The reward DPO's policy implies for each reply: ``beta * (logp - ref)``. (B, 2), (B, 2) -> (B, 2)."""
    return beta * (logprobs - ref_logprobs)


@dataclass(frozen=True)
class PreferenceStats:
    """Means over a set of pairs; implicit rewards are ``beta * (logp - ref)``."""

    loss: float
    reward_accuracy: float
    """Share of pairs whose chosen reply has the larger implicit reward (ties half)."""
    reward_margin: float
    chosen_reward: float
    rejected_reward: float
    chosen_logprob: float
    rejected_logprob: float

    def to_metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/loss``, ``<prefix>/rewards/{accuracy,margin,chosen,rejected}``, ``<prefix>/logps/...``."""
        return {f"{prefix}/loss": self.loss, f"{prefix}/rewards/accuracy": self.reward_accuracy,
                f"{prefix}/rewards/margin": self.reward_margin, f"{prefix}/rewards/chosen": self.chosen_reward,
                f"{prefix}/rewards/rejected": self.rejected_reward, f"{prefix}/logps/chosen": self.chosen_logprob,
                f"{prefix}/logps/rejected": self.rejected_logprob}


def preference_stats(losses: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     beta: float) -> PreferenceStats:
    """Stats of pairs from their losses (B,) and log-probs (B, 2)."""
    rewards = implicit_rewards(logprobs.detach().float(), ref_logprobs.float(), beta)  # (B, 2)
    logprobs = logprobs.detach().float()
    return PreferenceStats(float(losses.detach().mean()), pairwise_accuracy(rewards[:, 0], rewards[:, 1]),
                           float((rewards[:, 0] - rewards[:, 1]).mean()), float(rewards[:, 0].mean()),
                           float(rewards[:, 1].mean()), float(logprobs[:, 0].mean()), float(logprobs[:, 1].mean()))
