"""KL estimators between the policy and the reference, and the KL coefficient controllers.

Direction is always KL(policy || reference), estimated per token from samples of the policy:
``log_ratio = logprobs - ref_logprobs``. Per-token estimates can be negative for k1; the per-sequence sum
is an unbiased estimate of the true (non-negative) KL only in expectation. See README "Negative KL".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "abs"]

#: OpenRLHF clamps the log-ratio before exponentiating so one wild token cannot overflow k3.
LOG_RATIO_CLAMP = 10.0


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference). (B, T), (B, T) -> (B, T).

    - ``k1``: ``logp - logp_ref`` (unbiased, can be negative per token),
    - ``k2``: ``0.5 * (logp - logp_ref)^2`` (non-negative, biased),
    - ``k3``: ``(exp(logp_ref - logp) - 1) - (logp_ref - logp)`` (non-negative, unbiased, low variance),
    - ``abs``: ``|logp - logp_ref|``.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        neg = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.expm1(neg) - neg
    if estimator == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of k1, k2, k3, abs")


@dataclass
class FixedKLController:
    """A constant KL coefficient ``coef``."""

    coef: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: a fixed controller ignores the observed KL."""

    def state_dict(self) -> dict[str, float]:
        """JSON-serialisable state for checkpoints."""
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state_dict`."""
        self.coef = float(state["coef"])


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019).

    ``coef <- coef * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)``, where KL is the
    mean over the batch of the per-sequence KL (sum over response tokens), not a per-token mean.
    """

    coef: float
    target: float
    horizon: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``coef`` towards keeping the per-sequence KL at ``target`` after ``n_steps`` samples."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """JSON-serialisable state for checkpoints."""
        return {"coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state_dict`."""
        self.coef = float(state["coef"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


KLController = FixedKLController | AdaptiveKLController
