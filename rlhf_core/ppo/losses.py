"""PPO and reward-model losses as small pure functions.

Per-token terms are aggregated over ``response_mask`` by :func:`rlhf_core.ppo.aggregation.agg_loss`: given the
mini-batch's :class:`~rlhf_core.ppo.aggregation.Normaliser`, each function returns a micro-batch's share of the
mini-batch loss (and of its diagnostics); without one, the token mean over the batch given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf_core.ppo.aggregation import Normaliser, agg_loss


@dataclass(frozen=True)
class PolicyLossOutput:
    """Clipped-surrogate loss with its diagnostics (all scalars)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor
    dual_clipfrac: torch.Tensor
    """Fraction of real tokens where the dual clip bound the loss (verl's ``pg_clipfrac_lower``); 0 without it."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float = 0.2,
    normaliser: Normaliser | None = None,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate ``max(-A * r, -A * clip(r, 1 - eps, 1 + eps))``, aggregated over the mask.

    logprobs (with grad), old_logprobs, advantages, response_mask: (B, T).
    ``dual_clip`` (c > 1; verl's ``clip_ratio_c``): where ``A < 0`` the token's loss is further bounded by
    ``min(., -A * c)``, so a ratio that ran away on a bad token cannot dominate the batch (and gets no gradient).
    ``clipfrac`` is the fraction of real tokens where the clipped branch was taken (diagnostics are token means
    over the same tokens whatever the aggregation); ``dual_clipfrac`` where the dual clip bound;
    ``approx_kl = 0.5 * mean((logp - old_logp)^2)`` (the k2 estimate of KL(old || new)).
    """
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_token = torch.maximum(unclipped, clipped)
    dual_bound = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c; 3 there), got {dual_clip}")
        cap = -advantages * dual_clip
        dual_bound = (advantages < 0) & (per_token > cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    loss = agg_loss(per_token, response_mask, normaliser)
    diagnostics = normaliser.per_token() if normaliser is not None else None
    with torch.no_grad():
        clipfrac = agg_loss((clipped > unclipped).float(), response_mask, diagnostics)
        dual_clipfrac = agg_loss(dual_bound.float(), response_mask, diagnostics)
        approx_kl = 0.5 * agg_loss(log_ratio**2, response_mask, diagnostics)
        ratio_mean = agg_loss(ratio, response_mask, diagnostics)
    return PolicyLossOutput(loss, clipfrac, approx_kl, ratio_mean, dual_clipfrac)


@dataclass(frozen=True)
class ValueLossOutput:
    """Clipped value loss with its diagnostics (all scalars)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range_value: float | None = 0.2,
    normaliser: Normaliser | None = None,
) -> ValueLossOutput:
    """``0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)``, aggregated over the mask.

    values (with grad), old_values, returns, response_mask: (B, T). ``clip_range_value=None`` disables
    clipping (plain ``0.5 * (V - R)^2``).
    """
    zeros = torch.zeros_like(values)
    # Errors are masked BEFORE squaring: garbage (NaN/inf) in masked returns or old values would
    # otherwise give NaN * 0 = NaN gradients at masked positions, which then poison the critic.
    unclipped = torch.where(response_mask, values - returns, zeros) ** 2
    if clip_range_value is None:
        loss = 0.5 * agg_loss(unclipped, response_mask, normaliser)
        return ValueLossOutput(loss, torch.zeros((), device=values.device))
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    clipped = torch.where(response_mask, values_clipped - returns, zeros) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, normaliser)
    with torch.no_grad():
        # Tokens whose clipped term is the one taken; where the clamp did not bind, V_old + (V - V_old) differs from V
        # by rounding only, and counting those would make the fraction depend on thread count and micro-batch size.
        bound = (values - old_values).abs() > clip_range_value
        clipfrac = agg_loss(((clipped > unclipped) & bound).float(), response_mask,
                            normaliser.per_token() if normaliser is not None else None)
    return ValueLossOutput(loss, clipfrac)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Reward-model loss ``-log sigmoid(s_chosen - s_rejected - margin)``, batch mean. (B,), (B,) -> scalar."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def ppo_objective(
    pg_loss: torch.Tensor,
    vf_loss: torch.Tensor,
    entropy: torch.Tensor,
    vf_coef: float,
    entropy_coef: float,
    kl_loss: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The combined objective ``policy + c1 * value - c2 * entropy (+ kl_coef * KL)`` (all scalars)."""
    total = pg_loss + vf_coef * vf_loss - entropy_coef * entropy
    if kl_loss is not None:
        total = total + kl_coef * kl_loss
    return total
