"""KL estimators between the policy and the reference, and the KL coefficient controllers.

Direction is always KL(policy || reference), estimated per token from samples of the policy:
``log_ratio = logprobs - ref_logprobs``. Per-token estimates can be negative for k1; the per-sequence sum
is an unbiased estimate of the true (non-negative) KL only in expectation (docs/formulas.md, "Why negative KL
shows up").

Clamps, as the anchors apply them (their code, 2026):

- OpenRLHF (``compute_approx_kl``) clamps the *value* of every estimator (k1, k2, k3) to ``[-10, 10]`` and does
  not bound the log-ratio before exponentiating;
- verl (``kl_penalty``) clamps only k3 (``low_var_kl``): the log-ratio to ``[-20, 20]`` before exponentiating, then
  the value to ``[-10, 10]``; k1, k2 and abs are not clamped;
- TRL clamps nothing.

Here ``clamp`` (``ppo.kl.clamp``, default 10: OpenRLHF's) bounds the value of whichever estimator is configured,
for the KL penalty in the reward and the KL term in the loss. A clamped token contributes the bound and no
gradient: past a log-ratio of about -2.6, k3's penalty is 10 per token. k3's log-ratio is always bounded to
``[-20, 20]`` before ``exp`` (verl's guard), so neither the value nor its gradient overflows whatever the clamp.
Diagnostics (``ppo/kl/k3_mean``, evaluation KL) are unclamped estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "abs"]

#: OpenRLHF's clamp of every estimator's value (verl's for k3): ``ppo.kl.clamp``'s default.
VALUE_CLAMP = 10.0
#: verl bounds k3's log-ratio before exponentiating, so exp (and its gradient) stays finite in float32.
K3_LOG_RATIO_BOUND = 20.0


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1", clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference). (B, T), (B, T) -> (B, T).

    - ``k1``: ``logp - logp_ref`` (unbiased, can be negative per token),
    - ``k2``: ``0.5 * (logp - logp_ref)^2`` (non-negative, biased),
    - ``k3``: ``(exp(logp_ref - logp) - 1) - (logp_ref - logp)`` (non-negative, unbiased, low variance), its
      log-ratio bounded to ``[-20, 20]`` first,
    - ``abs``: ``|logp - logp_ref|``.

    ``clamp``: the value is clamped to ``[-clamp, clamp]`` (OpenRLHF: 10 for every estimator); None = unclamped.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = 0.5 * log_ratio**2
    elif estimator == "k3":
        neg = (-log_ratio).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        value = torch.expm1(neg) - neg
    elif estimator == "abs":
        value = log_ratio.abs()
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of k1, k2, k3, abs")
    return value if clamp is None else value.clamp(-clamp, clamp)


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
