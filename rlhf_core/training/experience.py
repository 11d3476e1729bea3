"""Experience collection: generate -> old log-probs / values / reference log-probs -> scores -> rewards -> GAE.

Everything here runs without gradients; the results are constants for the PPO update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from rlhf_core.config import PPOConfig
from rlhf_core.models.budget import row_chunks
from rlhf_core.models.memory import autocast
from rlhf_core.models.packing import supports_packing
from rlhf_core.models.roles import Critic, ValueHead, critic_forward, policy_forward
from rlhf_core.models.scoring import Scorer
from rlhf_core.models.sequences import Rollout
from rlhf_core.ppo.advantages import baseline_scores, gae, returns_to_go, sequence_advantages, whiten_advantages
from rlhf_core.ppo.kl import kl_estimate
from rlhf_core.ppo.masking import masked_mean, masked_sum
from rlhf_core.ppo.rewards import RunningMoments, shape_scores, token_rewards
from rlhf_core.ppo.stats import RolloutStats
from rlhf_core.training.rollout import generate_in_batches


@dataclass
class PPOModels:
    """The four roles. At most one of ``value_head`` / ``critic`` is set; neither for a critic-free estimator."""

    policy: nn.Module
    reference: nn.Module
    scorer: Scorer
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    value_head: ValueHead | None = None
    critic: Critic | None = None

    def __post_init__(self) -> None:
        if self.value_head is not None and self.critic is not None:
            raise ValueError("PPOModels takes one value model: value_head (on the policy) or critic, not both")

    @property
    def value_model(self) -> nn.Module | None:
        """The trained value model: the value head, the critic, or None (critic-free estimators)."""
        return self.value_head if self.value_head is not None else self.critic

    def value_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the value model (none without one)."""
        module = self.value_model
        return [] if module is None else [p for p in module.parameters() if p.requires_grad]


GatherScored = Callable[
    [Rollout, tuple[torch.Tensor, ...], torch.Tensor], tuple[Rollout, tuple[torch.Tensor, ...], torch.Tensor]
]
"""(rollout, per-token tensors, scores) of this rank -> the same for the whole batch (rlhf_core.training.strategy)."""


@dataclass
class Experience:
    """A scored rollout batch with everything the update needs. Per-token tensors are (B, Tr)."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    scores: torch.Tensor
    """(B,) shaped sequence scores."""
    rewards: torch.Tensor
    advantages: torch.Tensor
    """Whitened when configured."""
    returns: torch.Tensor

    def select(self, index: torch.Tensor) -> Experience:
        """Rows ``index`` of every field."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Experience(**{k: v.select(index) if isinstance(v, Rollout) else v[index] for k, v in values.items()})


@torch.no_grad()
def old_policy_outputs(
    models: PPOModels, rollout: Rollout, temperature: float, batch_size: int, max_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Old log-probs, reference log-probs and old values, in chunks of at most ``batch_size`` rollouts and
    ``max_tokens`` tokens (``budget.row_chunks``). -> three (B, Tr) tensors."""
    query_len = rollout.query_ids.shape[1]
    logprobs, ref_logprobs, values = [], [], []
    packed = supports_packing(models.policy)
    for rows in row_chunks(rollout.attention_mask, batch_size, max_tokens, packed):
        chunk = rollout.select(slice(rows.start, rows.stop))
        ids, mask = chunk.input_ids, chunk.attention_mask
        out = policy_forward(models.policy, ids, mask, query_len, temperature, models.value_head)
        logprobs.append(out.logprobs)
        ref_logprobs.append(policy_forward(models.reference, ids, mask, query_len, temperature).logprobs)
        if out.values is not None:
            values.append(out.values)
        elif models.critic is not None:
            values.append(critic_forward(models.critic, ids, mask, query_len))
        else:  # critic-free: no values (zeros keep the batch's shapes; nothing reads them)
            values.append(torch.zeros_like(out.logprobs, dtype=torch.float32))
    return torch.cat(logprobs), torch.cat(ref_logprobs), torch.cat(values)


def collect_experience(
    models: PPOModels,
    prompts: Sequence[Sequence[int]],
    config: PPOConfig,
    kl_coef: float,
    generator: torch.Generator,
    moments: RunningMoments,
    gather: GatherScored | None = None,
) -> tuple[Experience, RolloutStats, float, float]:
    """Generate and score one rollout batch. Returns (experience, stats, generation s, scoring s).

    Generation (prefill and decode) and the old and reference log-probs and values run under ``config.autocast``,
    the precision of the training forward: the first mini-batch's ratio is 1, and under LoRA the float32 adapters
    do not upcast every layer of a bf16 model while it samples. ``gather`` (data-parallel) joins every rank's
    scored share into the whole batch before rewards and advantages, which are whitened over the whole batch.
    """
    device = next(models.policy.parameters()).device
    started = time.monotonic()
    with autocast(config.autocast, device):
        rollouts = list(generate_in_batches(models.policy, prompts, config.generation, models.stop_token_ids,
                                            models.pad_token_id, generator))
    rollout = concat_rollouts(rollouts, models.pad_token_id)
    generated = time.monotonic()
    with autocast(config.autocast, device):
        old_logprobs, ref_logprobs, old_values = old_policy_outputs(
            models, rollout, config.generation.temperature, config.micro_batch_size, config.max_tokens_per_forward
        )
    raw_scores = models.scorer(rollout).to(device).float()
    if gather is not None:
        rollout, (old_logprobs, ref_logprobs, old_values), raw_scores = gather(
            rollout, (old_logprobs, ref_logprobs, old_values), raw_scores)
    scored = time.monotonic()
    experience, stats = build_experience(rollout, old_logprobs, ref_logprobs, old_values, raw_scores, config, kl_coef,
                                         moments)
    return experience, stats, generated - started, scored - generated


def build_experience(
    rollout: Rollout,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    raw_scores: torch.Tensor,
    config: PPOConfig,
    kl_coef: float,
    moments: RunningMoments,
) -> tuple[Experience, RolloutStats]:
    """Scores -> per-token rewards -> advantages and returns (before whitening) -> whitened advantages.

    Critic-free estimators put the baseline-adjusted score (``baseline_scores``) where the score goes and take
    the returns-to-go as advantages; ``rewards`` (and ``ppo/rewards/mean``) keep the plain score either way.
    """
    mask = rollout.response_mask
    shaping = config.reward
    scores = shape_scores(raw_scores, rollout.stopped, shaping.missing_stop_penalty, shaping.clip,
                          moments if shaping.normalize else None)
    kl = kl_estimate(old_logprobs, ref_logprobs, config.kl.estimator, config.kl.clamp)
    penalty_coef = kl_coef if config.kl.placement == "reward" else 0.0
    rewards = token_rewards(scores, kl, penalty_coef, mask)
    if config.advantage == "gae":
        advantages, returns = gae(rewards, old_values, mask, config.gamma, config.lam)
        if config.critic_lam is not None and config.critic_lam != config.lam:  # VC-PPO: the critic's own targets
            _, returns = gae(rewards, old_values, mask, config.gamma, config.critic_lam)
    elif config.advantage == "sequence":
        advantages, returns = sequence_advantages(rewards, old_values, mask)
    else:
        adjusted = baseline_scores(scores, config.advantage, config.samples_per_prompt, config.grpo_scale_by_std)
        advantages = returns = returns_to_go(token_rewards(adjusted, kl, penalty_coef, mask), mask, config.gamma)
    raw_advantage_mean = float(masked_mean(advantages, mask))
    if config.whitens:
        advantages = whiten_advantages(advantages, mask)
    experience = Experience(rollout, old_logprobs, ref_logprobs, old_values, scores, rewards, advantages, returns)
    k3 = kl_estimate(old_logprobs, ref_logprobs, "k3")
    stats = RolloutStats(
        score_mean=float(scores.mean()),
        score_std=float(scores.std(unbiased=False)),
        raw_score_mean=float(raw_scores.mean()),
        reward_mean=float(masked_sum(rewards, mask, dim=1).mean()),
        kl_mean=float(masked_sum(kl, mask, dim=1).mean()),
        kl_k3_mean=float(masked_sum(k3, mask, dim=1).mean()),
        kl_coef=kl_coef,
        response_length_mean=float(mask.sum(dim=1).float().mean()),
        stop_rate=float(rollout.stopped.float().mean()),
        value_mean=float(masked_mean(old_values, mask)),
        advantage_mean=raw_advantage_mean,
        return_mean=float(masked_mean(returns, mask)),
    )
    return experience, stats


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollout chunks whose query and response widths differ (queries left-, responses right-padded)."""
    if len(parts) == 1:
        return parts[0]
    q_width = max(p.query_ids.shape[1] for p in parts)
    r_width = max(p.response_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, width: int, value: float | bool, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        query_ids=torch.cat([pad(p.query_ids, q_width, pad_token_id, True) for p in parts]),
        query_mask=torch.cat([pad(p.query_mask, q_width, False, True) for p in parts]),
        response_ids=torch.cat([pad(p.response_ids, r_width, pad_token_id, False) for p in parts]),
        response_mask=torch.cat([pad(p.response_mask, r_width, False, False) for p in parts]),
        logprobs=torch.cat([pad(p.logprobs, r_width, 0.0, False) for p in parts]),
        stopped=torch.cat([p.stopped for p in parts]),
    )


def gather_scored_rollouts(
    all_gather: Callable[[Any], list[Any]],
    pad_token_id: int,
    rollout: Rollout,
    per_token: tuple[torch.Tensor, ...],
    scores: torch.Tensor,
) -> tuple[Rollout, tuple[torch.Tensor, ...], torch.Tensor]:
    """Every rank's share of a scored rollout batch, concatenated in rank order (= prompt order).

    per_token: (B_rank, Tr_rank) tensors (old / reference log-probs, values); responses and per-token tensors
    are right-padded (with pad and 0) and prompts left-padded to the widest rank. scores: (B_rank,).
    """
    device = scores.device
    local = (rollout.select(slice(None)), per_token, scores)
    parts = all_gather(_to_cpu(local))
    full = concat_rollouts([p[0] for p in parts], pad_token_id)
    width = full.response_ids.shape[1]

    def right_pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0.0)

    gathered = tuple(torch.cat([right_pad(p[1][i]) for p in parts]).to(device) for i in range(len(per_token)))
    full = Rollout(**{name: getattr(full, name).to(device) for name in vars(full)})
    return full, gathered, torch.cat([p[2] for p in parts]).to(device)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Rollout):
        return Rollout(**{name: value.detach().cpu() for name, value in vars(obj).items()})
    if isinstance(obj, tuple):
        return tuple(_to_cpu(o) for o in obj)
    return obj
