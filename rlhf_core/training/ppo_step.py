"""One PPO step: collect experience, then ``ppo_epochs`` passes of mini-batches with gradient accumulation.

Reads top to bottom like the algorithm: :func:`ppo_step` = :func:`collect_experience` ->
:func:`ppo_update` -> KL controller update (-> optional reference refresh).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from rlhf_core.config import PPOConfig
from rlhf_core.models.budget import row_chunks, same_count
from rlhf_core.models.lora import AdapterDisabled
from rlhf_core.models.memory import autocast, enable_gradient_checkpointing
from rlhf_core.models.offload import OffloadPlan, offload_plan, parked, scorer_networks
from rlhf_core.models.packing import supports_packing
from rlhf_core.models.roles import critic_forward, policy_forward
from rlhf_core.ppo.aggregation import Normaliser, agg_loss
from rlhf_core.ppo.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_estimate,
)
from rlhf_core.ppo.losses import ValueLossOutput, policy_loss, ppo_objective, value_loss
from rlhf_core.ppo.masking import masked_var
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.ppo.stats import PPOStats, TimeStats, UpdateStats
from rlhf_core.training.experience import Experience, PPOModels, collect_experience, gather_scored_rollouts
from rlhf_core.training.strategy import (
    LocalStrategy,
    Strategy,
    StrategyFactory,
    TrainableGroup,
    local_strategy,
    refuse_non_finite,
    schedule,
    shard,
)


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


def trainable_groups(models: PPOModels, config: PPOConfig) -> list[TrainableGroup]:
    """The trained models, policy first, then the value model when there is one: each gets its own learning rate
    and gradient-norm clip."""
    groups = [TrainableGroup(models.policy, [p for p in models.policy.parameters() if p.requires_grad],
                             config.learning_rate)]
    if models.value_model is not None:
        groups.append(TrainableGroup(models.value_model, models.value_parameters(), config.value_learning_rate))
    return groups


def lr_lambda(config: PPOConfig) -> Callable[[int], float]:
    """Learning-rate factor per optimizer step (:func:`rlhf_core.training.strategy.schedule`): linear warm-up, then
    constant or linear decay to 0 over every optimizer step of the run."""
    minibatches = config.rollout_batch_size // config.mini_batch_size
    return schedule(config, max(1, config.total_updates * config.ppo_epochs * minibatches))


def prepare_training(
    models: PPOModels, config: PPOConfig, make_strategy: StrategyFactory | None = None
) -> tuple[PPOModels, Strategy]:
    """The strategy that trains ``models`` (default: AdamW in this process) and the models to train with.

    Under DeepSpeed the returned policy and value model are the engines wrapping the given ones (training
    forwards must go through them); in one process they are the given modules.
    """
    factory = make_strategy or local_strategy
    strategy = factory(trainable_groups(models, config), config.weight_decay, config.max_grad_norm, lr_lambda(config))
    policy, *value = strategy.modules
    return _with_trained(models, policy, value[0] if value else None), strategy


def _with_trained(models: PPOModels, policy: torch.nn.Module, value: torch.nn.Module | None) -> PPOModels:
    """``models`` with another policy and value model (engines, or rollout copies of them)."""
    if models.value_head is not None:
        return replace(models, policy=policy, value_head=value)
    if models.critic is not None:
        return replace(models, policy=policy, critic=value)
    return replace(models, policy=policy)


def ppo_step(
    models: PPOModels,
    strategy: Strategy,
    state: PPOState,
    prompts: Sequence[Sequence[int]],
    config: PPOConfig,
) -> PPOStats:
    """One PPO iteration on a batch of tokenized prompts (``config.prompts_per_update`` of them, each sampled
    ``config.samples_per_prompt`` times: ``config.rollout_batch_size`` rollouts, a prompt's replies side by side).

    ``strategy`` applies the gradients (:func:`prepare_training` builds it and the models to train with).
    Data-parallel, every rank passes the same prompts, generates and scores its contiguous share with its own
    sampling generator, and then holds the whole scored batch (advantages are whitened over all of it).
    With ``config.offload_frozen`` the frozen networks of :func:`frozen_offload` wait in host memory while
    :func:`ppo_update` trains (the time it takes to move them counts as training time) and are back on their
    device for the reference refresh and the next rollout: every model ends the step where it started.
    """
    if len(prompts) != config.prompts_per_update:
        raise ValueError(f"ppo_step got {len(prompts)} prompts; it takes ppo.rollout_batch_size / "
                         f"ppo.samples_per_prompt = {config.prompts_per_update}")
    prompts = [prompt for prompt in prompts for _ in range(config.samples_per_prompt)]
    kl_coef = state.kl_controller.coef
    gather = None
    if strategy.world_size > 1:
        gather = functools.partial(gather_scored_rollouts, strategy.all_gather, models.pad_token_id)
    trained_value = models.value_model
    # Rollouts run on modules that need no other rank (ZeRO-3: full copies for the phase; else the same modules).
    value_inference = strategy.inference(trained_value) if trained_value is not None else contextlib.nullcontext()
    with strategy.inference(models.policy) as policy, value_inference as value:
        experience, rollout_stats, t_gen, t_score = collect_experience(
            _with_trained(models, policy, value), shard(prompts, strategy.rank, strategy.world_size, "rollout batch"),
            config, kl_coef, strategy.sampling_generator(state.generator), state.score_moments, gather=gather,
        )
    started = time.monotonic()
    train_policy = state.step >= config.critic_warmup_updates  # ppo.critic_warmup_updates: the value model alone
    with parked(list(frozen_offload(models, config).moved.values())):  # ppo.offload_frozen
        update_stats = ppo_update(models, strategy, experience, config, kl_coef, state.generator, train_policy)
    t_train = time.monotonic() - started
    state.kl_controller.update(rollout_stats.kl_mean, config.rollout_batch_size)
    state.step += 1
    if config.ref_refresh_every and state.step % config.ref_refresh_every == 0:
        refresh_reference(models, strategy, state.step)
    return PPOStats(state.step, rollout_stats, update_stats, TimeStats(t_gen, t_score, t_train))


def frozen_offload(models: PPOModels, config: PPOConfig) -> OffloadPlan:
    """What ``ppo.offload_frozen`` holds in host memory while the policy and value model train: the reference and
    the reward model(s) unless they own no weights or share some with a trained model (nothing when it is off)."""
    if not config.offload_frozen:
        return OffloadPlan({}, {})
    frozen = {"reference": models.reference, **scorer_networks(models.scorer)}
    return offload_plan(frozen, [models.policy, models.value_model])


def refresh_reference(models: PPOModels, strategy: Strategy, step: int) -> None:
    """The reference becomes the current policy: a weight copy, or with LoRA (reference = adapter disabled)
    the adapter merged into the shared base weights and restarted."""
    if isinstance(models.reference, AdapterDisabled):
        if not isinstance(strategy, LocalStrategy):
            raise ValueError("a LoRA reference refresh restarts the adapter's torch optimizer moments, which "
                             "DeepSpeed keeps to itself: set ppo.ref_refresh_every=0 or train in one process")
        models.reference.refresh(strategy.optimizer, seed=step)
    else:
        models.reference.load_state_dict(strategy.full_state_dict(models.policy))


def ppo_update(
    models: PPOModels,
    strategy: Strategy,
    experience: Experience,
    config: PPOConfig,
    kl_coef: float,
    generator: torch.Generator,
    train_policy: bool = True,
) -> UpdateStats:
    """``ppo_epochs`` shuffled passes of mini-batches; each mini-batch accumulates micro-batch gradients.

    ``train_policy=False`` (critic warm-up) trains the value model alone: the loss is its value term, the policy's
    weights get no gradient (a value head reads them detached) and its optimizer step is skipped.

    Every loss term is normalised by the whole mini-batch (``ppo.loss_aggregation``, :mod:`rlhf_core.ppo.aggregation`),
    so the micro-batches' losses add up to the mini-batch's loss: micro-batch size and process count change memory
    and speed, never the update. Data-parallel, each rank runs the micro-batches of its contiguous share of every
    mini-batch (the same micro-batches one process would run, split between ranks); the strategy averages the
    gradients over ranks, so each rank's share of the sum is scaled by the number of ranks. Micro-batches hold at
    most ``ppo.micro_batch_size`` rollouts and ``ppo.max_tokens_per_forward`` tokens (:func:`training_micro_batches`).
    """
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(models.policy)
        if models.critic is not None:
            enable_gradient_checkpointing(models.critic)
    batch = experience.rollout.query_ids.shape[0]
    packed = supports_packing(models.policy)
    if config.mini_batch_size % (config.micro_batch_size * strategy.world_size):
        raise ValueError(f"ppo.mini_batch_size ({config.mini_batch_size}) must be a multiple of ppo.micro_batch_size "
                         f"x processes ({config.micro_batch_size} x {strategy.world_size})")
    device = experience.old_logprobs.device
    totals: dict[str, float] = {}
    norms: dict[str, float] = {}
    n_minibatches = 0
    for _ in range(config.ppo_epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, config.mini_batch_size):
            whole = order[start : start + config.mini_batch_size]
            normaliser = Normaliser.of(experience.rollout.response_mask[whole.to(device)], config.loss_aggregation,
                                       config.generation.max_new_tokens)
            strategy.zero_grad()
            for rows, counted in training_micro_batches(whole, experience.rollout.attention_mask, strategy, config,
                                                        packed):
                micro = experience.select(rows.to(device))
                with autocast(config.autocast, device):
                    loss, parts = micro_batch_loss(models, micro, config, kl_coef, normaliser, train_policy)
                refuse_non_finite(strategy, "PPO loss", float(loss.detach()), parts)
                strategy.backward(loss * (strategy.world_size if counted else 0.0))
                if counted:  # a weight-0 repeat only keeps this rank's collectives in step with the others'
                    _accumulate(totals, parts, 1.0)
            policy_norm, *value_norm = strategy.step(frozen=() if train_policy else (0,))
            _accumulate(norms, {"policy_grad_norm": policy_norm, "value_grad_norm": sum(value_norm)}, 1.0)
            n_minibatches += 1
    # Each rank holds its share of every mini-batch's losses: summed over ranks, they are the mini-batch's.
    # Gradient norms are the same on every rank (taken after the reduction): averaged over ranks.
    summed = strategy.all_sum({**totals, **norms})
    means = {k: v / (n_minibatches * (strategy.world_size if k in norms else 1)) for k, v in summed.items()}
    return UpdateStats(
        **means,
        explained_variance=explained_variance(experience.old_values, experience.returns, experience.rollout.response_mask),
        learning_rate=strategy.learning_rate(),
        critic_warmup=0.0 if train_policy else 1.0,
    )


def training_micro_batches(whole: torch.Tensor, attention_mask: torch.Tensor, strategy: Strategy, config: PPOConfig,
                           packed: bool) -> list[tuple[torch.Tensor, bool]]:
    """This rank's share of the mini-batch ``whole`` (row indices into the experience) as micro-batches
    ``(rows, counted)``, consecutive and in order.

    Each holds at most ``ppo.micro_batch_size`` rollouts and ``ppo.max_tokens_per_forward`` tokens of
    ``attention_mask`` (B, T) (``budget.row_chunks``: real tokens where the policy packs rows, else rows x T).
    Every rank runs as many as the rank that needs most (ZeRO-3's gathers and DeepSpeed's backward are collective;
    ``budget.same_count``). Without a token budget: ``micro_batch_size`` rows at a time, on every rank alike.
    """
    def plan(share: torch.Tensor) -> list[range]:
        mask = attention_mask[share.to(attention_mask.device)]
        return row_chunks(mask, config.micro_batch_size, config.max_tokens_per_forward, packed)

    world = strategy.world_size
    plans = [plan(shard(whole, rank, world)) for rank in range(world)]
    mine = shard(whole, strategy.rank, world)
    return [(mine[chunk.start:chunk.stop], counted) for chunk, counted in same_count(plans, strategy.rank)]


def micro_batch_loss(
    models: PPOModels, micro: Experience, config: PPOConfig, kl_coef: float, normaliser: Normaliser | None = None,
    train_policy: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Combined objective ``policy + c1 * value - c2 * entropy (+ kl_coef * KL when the KL is in the loss)``: this
    micro-batch's share of it, every term aggregated with the mini-batch's ``normaliser`` (None: the micro-batch
    is the whole mini-batch). Without a value model (critic-free estimators) there is no value term.
    ``train_policy=False`` (critic warm-up): the loss is ``c1 * value`` alone and reaches no policy weight; the policy
    terms are still reported."""
    rollout = micro.rollout
    ids, attention, mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
    query_len = rollout.query_ids.shape[1]
    if normaliser is None:
        normaliser = Normaliser.of(mask, config.loss_aggregation, config.generation.max_new_tokens)
    value_head = models.value_head
    if not train_policy and value_head is not None:
        value_head = DetachedInput(value_head)
    with torch.set_grad_enabled(torch.is_grad_enabled() and (train_policy or value_head is not None)):
        out = policy_forward(models.policy, ids, attention, query_len, config.generation.temperature, value_head,
                             with_entropy=True)
    pg = policy_loss(out.logprobs, micro.old_logprobs, micro.advantages, mask, config.clip_range, normaliser,
                     config.dual_clip)
    if models.value_model is not None:
        values = out.values if out.values is not None else critic_forward(models.critic, ids, attention, query_len)
        vf = value_loss(values, micro.old_values, micro.returns, mask, config.clip_range_value, normaliser)
    else:
        zero = torch.zeros((), device=out.logprobs.device)
        vf = ValueLossOutput(zero, zero)
    entropy = agg_loss(out.entropy, mask, normaliser)
    with torch.no_grad():
        entropy_per_token = agg_loss(out.entropy, mask, normaliser.per_token())
    kl_loss = None
    if config.kl.placement == "loss":
        kl_loss = agg_loss(kl_estimate(out.logprobs, micro.ref_logprobs, config.kl.estimator, config.kl.clamp), mask,
                           normaliser)
    if train_policy:
        loss = ppo_objective(pg.loss, vf.loss, entropy, config.vf_coef, config.entropy_coef, kl_loss, kl_coef)
    else:
        loss = config.vf_coef * vf.loss
    parts = {
        "policy_loss": float(pg.loss.detach()),
        "value_loss": float(vf.loss.detach()),
        "entropy": float(entropy_per_token),
        "clipfrac": float(pg.clipfrac),
        "dual_clipfrac": float(pg.dual_clipfrac),
        "value_clipfrac": float(vf.clipfrac),
        "approx_kl": float(pg.approx_kl),
        "ratio_mean": float(pg.ratio_mean),
    }
    return loss, parts


class DetachedInput(torch.nn.Module):
    """``module`` applied to a detached input: a value head trained on the policy's hidden states without sending
    gradients into the policy (critic warm-up)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module(hidden.detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over real tokens (1 = perfect critic, <= 0 = useless)."""
    var_returns = masked_var(returns, mask, unbiased=False)
    if float(var_returns) == 0.0:
        return 0.0
    return float(1.0 - masked_var(returns - values, mask, unbiased=False) / var_returns)


def _accumulate(totals: dict[str, float], parts: dict[str, float], weight: float) -> None:
    for key, value in parts.items():
        totals[key] = totals.get(key, 0.0) + weight * value
