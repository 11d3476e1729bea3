"""Typed PPO statistics, turned into metric names (``ppo/policy/clipfrac`` ...) in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class RolloutStats:
    """What the rollout batch looked like before the update."""

    score_mean: float
    """Mean sequence score from the reward source(s), after shaping."""
    score_std: float
    raw_score_mean: float
    """Mean sequence score before shaping / normalisation."""
    reward_mean: float
    """Mean per-sequence total reward (score - kl_coef * KL)."""
    kl_mean: float
    """Mean per-sequence KL(policy || reference), summed over tokens, with the configured estimator."""
    kl_k3_mean: float
    """Same, with the non-negative k3 estimator (shown next to k1, which can be negative)."""
    kl_coef: float
    """The KL coefficient used for this batch."""
    response_length_mean: float
    stop_rate: float
    """Fraction of responses that ended with a stop token."""
    value_mean: float
    advantage_mean: float
    """Before whitening."""
    return_mean: float


@dataclass
class UpdateStats:
    """Means over every mini-batch of every PPO epoch."""

    policy_loss: float
    value_loss: float
    entropy: float
    clipfrac: float
    dual_clipfrac: float
    """Tokens where the dual clip bound the policy loss (``ppo.dual_clip``; 0 without it)."""
    value_clipfrac: float
    approx_kl: float
    ratio_mean: float
    explained_variance: float
    policy_grad_norm: float
    value_grad_norm: float
    learning_rate: float
    critic_warmup: float = 0.0
    """1 while ``ppo.critic_warmup_updates`` holds the policy still (only the value model trained), else 0."""


@dataclass
class TimeStats:
    """Wall-clock split of one PPO step, seconds."""

    generation: float
    scoring: float
    training: float


@dataclass
class PPOStats:
    """Everything one PPO step reports."""

    step: int
    rollout: RolloutStats
    update: UpdateStats
    time: TimeStats

    def to_metrics(self) -> dict[str, float]:
        """Flat metric names for trackers (MLflow, logs)."""
        names = {
            "rollout": {
                "score_mean": "ppo/scores/mean",
                "score_std": "ppo/scores/std",
                "raw_score_mean": "ppo/scores/raw_mean",
                "reward_mean": "ppo/rewards/mean",
                "kl_mean": "ppo/kl/mean",
                "kl_k3_mean": "ppo/kl/k3_mean",
                "kl_coef": "ppo/kl/coef",
                "response_length_mean": "ppo/response/length_mean",
                "stop_rate": "ppo/response/stop_rate",
                "value_mean": "ppo/values/mean",
                "advantage_mean": "ppo/advantages/mean",
                "return_mean": "ppo/returns/mean",
            },
            "update": {
                "policy_loss": "ppo/policy/loss",
                "value_loss": "ppo/value/loss",
                "entropy": "ppo/policy/entropy",
                "clipfrac": "ppo/policy/clipfrac",
                "dual_clipfrac": "ppo/policy/dual_clipfrac",
                "value_clipfrac": "ppo/value/clipfrac",
                "approx_kl": "ppo/policy/approx_kl",
                "ratio_mean": "ppo/policy/ratio_mean",
                "explained_variance": "ppo/value/explained_variance",
                "policy_grad_norm": "ppo/policy/grad_norm",
                "value_grad_norm": "ppo/value/grad_norm",
                "learning_rate": "ppo/learning_rate",
                "critic_warmup": "ppo/critic_warmup",
            },
            "time": {"generation": "time/generation", "scoring": "time/scoring", "training": "time/training"},
        }
        metrics = {}
        for group, mapping in names.items():
            part = getattr(self, group)
            for f in fields(part):
                metrics[mapping[f.name]] = float(getattr(part, f.name))
        return metrics
