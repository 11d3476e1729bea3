"""One PPO step: collect experience, then ``ppo_epochs`` passes of mini-batches with gradient accumulation.

Reads top to bottom like the algorithm: :func:`ppo_step` = :func:`collect_experience` ->
:func:`ppo_update` -> KL controller update (-> optional reference refresh).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlhf_core.config import PPOConfig
from rlhf_core.experience import Experience, PPOModels, collect_experience
from rlhf_core.kl import AdaptiveKLController, FixedKLController, KLController, kl_estimate
from rlhf_core.losses import policy_loss, ppo_objective, value_loss
from rlhf_core.masking import masked_mean, masked_var
from rlhf_core.models import critic_forward, policy_forward
from rlhf_core.rewards import RunningMoments
from rlhf_core.stats import PPOStats, TimeStats, UpdateStats


@dataclass
class PPOState:
    """Mutable state that a resumed run must restore exactly (with the weights and the optimizer)."""

    kl_controller: KLController
    generator: torch.Generator
    step: int = 0
    score_moments: RunningMoments = field(default_factory=RunningMoments)


def make_kl_controller(config: PPOConfig) -> KLController:
    """Fixed or adaptive controller from the config."""
    if config.kl.adaptive:
        return AdaptiveKLController(config.kl.coef, config.kl.target, config.kl.horizon)
    return FixedKLController(config.kl.coef)


def make_optimizer(
    models: PPOModels, config: PPOConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with two parameter groups (policy, value model) and a constant or linear schedule."""
    policy_params = [p for p in models.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": policy_params, "lr": config.learning_rate},
            {"params": models.value_parameters(), "lr": config.value_learning_rate},
        ],
        weight_decay=config.weight_decay,
    )
    minibatches = config.rollout_batch_size // config.mini_batch_size
    total = max(1, config.total_updates * config.ppo_epochs * minibatches)
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.lr_schedule == "linear":
            return max(0.0, 1.0 - (step - warmup) / max(1, total - warmup))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def ppo_step(
    models: PPOModels,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: PPOState,
    prompts: Sequence[Sequence[int]],
    config: PPOConfig,
) -> PPOStats:
    """One PPO iteration on a batch of tokenized prompts (``config.rollout_batch_size`` of them)."""
    if len(prompts) != config.rollout_batch_size:
        raise ValueError(f"ppo_step got {len(prompts)} prompts; ppo.rollout_batch_size is {config.rollout_batch_size}")
    beta = state.kl_controller.value
    experience, rollout_stats, t_gen, t_score = collect_experience(
        models, prompts, config, beta, state.generator, state.score_moments
    )
    started = time.monotonic()
    update_stats = ppo_update(models, optimizer, scheduler, experience, config, beta, state.generator)
    t_train = time.monotonic() - started
    state.kl_controller.update(rollout_stats.kl_mean, config.rollout_batch_size)
    state.step += 1
    if config.ref_refresh_every and state.step % config.ref_refresh_every == 0:
        models.reference.load_state_dict(models.policy.state_dict())
    return PPOStats(state.step, rollout_stats, update_stats, TimeStats(t_gen, t_score, t_train))


def ppo_update(
    models: PPOModels,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    experience: Experience,
    config: PPOConfig,
    beta: float,
    generator: torch.Generator,
) -> UpdateStats:
    """``ppo_epochs`` shuffled passes of mini-batches; each mini-batch accumulates micro-batch gradients."""
    batch = experience.rollout.query_ids.shape[0]
    accumulation = config.mini_batch_size // config.micro_batch_size
    totals: dict[str, float] = {}
    n_minibatches = 0
    for _ in range(config.ppo_epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, config.mini_batch_size):
            mini = order[start : start + config.mini_batch_size]
            optimizer.zero_grad(set_to_none=True)
            for micro_start in range(0, config.mini_batch_size, config.micro_batch_size):
                micro = experience.select(mini[micro_start : micro_start + config.micro_batch_size].to(experience.old_logprobs.device))
                loss, parts = micro_batch_loss(models, micro, config, beta)
                (loss / accumulation).backward()
                _accumulate(totals, parts, 1.0 / accumulation)
            policy_norm = torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], config.max_grad_norm)
            value_norm = torch.nn.utils.clip_grad_norm_(optimizer.param_groups[1]["params"], config.max_grad_norm)
            _accumulate(totals, {"policy_grad_norm": float(policy_norm), "value_grad_norm": float(value_norm)}, 1.0)
            optimizer.step()
            scheduler.step()
            n_minibatches += 1
    means = {k: v / n_minibatches for k, v in totals.items()}
    return UpdateStats(
        **means,
        explained_variance=explained_variance(experience.old_values, experience.returns, experience.rollout.response_mask),
        learning_rate=float(optimizer.param_groups[0]["lr"]),
    )


def micro_batch_loss(
    models: PPOModels, micro: Experience, config: PPOConfig, beta: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Combined objective ``policy + c1 * value - c2 * entropy (+ beta * KL when the KL is in the loss)``."""
    rollout = micro.rollout
    ids, attention, mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
    query_len = rollout.query_ids.shape[1]
    out = policy_forward(
        models.policy, ids, attention, query_len, config.generation.temperature, models.value_head, with_entropy=True
    )
    values = out.values if out.values is not None else critic_forward(models.critic, ids, attention, query_len)
    pg = policy_loss(out.logprobs, micro.old_logprobs, micro.advantages, mask, config.clip_range)
    vf = value_loss(values, micro.old_values, micro.returns, mask, config.clip_range_value)
    entropy = masked_mean(out.entropy, mask)
    kl_loss = None
    if config.kl.placement == "loss":
        kl_loss = masked_mean(kl_estimate(out.logprobs, micro.ref_logprobs, config.kl.estimator), mask)
    loss = ppo_objective(pg.loss, vf.loss, entropy, config.vf_coef, config.entropy_coef, kl_loss, beta)
    parts = {
        "policy_loss": float(pg.loss.detach()),
        "value_loss": float(vf.loss.detach()),
        "entropy": float(entropy.detach()),
        "clipfrac": float(pg.clipfrac),
        "value_clipfrac": float(vf.clipfrac),
        "approx_kl": float(pg.approx_kl),
        "ratio_mean": float(pg.ratio_mean),
    }
    return loss, parts


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over real tokens (1 = perfect critic, <= 0 = useless)."""
    var_returns = masked_var(returns, mask, unbiased=False)
    if float(var_returns) == 0.0:
        return 0.0
    return float(1.0 - masked_var(returns - values, mask, unbiased=False) / var_returns)


def _accumulate(totals: dict[str, float], parts: dict[str, float], weight: float) -> None:
    for key, value in parts.items():
        totals[key] = totals.get(key, 0.0) + weight * value
