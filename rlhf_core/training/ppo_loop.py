"""The PPO training loop over a prompt table, with periodic checkpoints and exact resume."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_core.config import PPOConfig
from rlhf_core.models.scoring import scorer_identity
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.ppo.stats import PPOStats
from rlhf_core.training.checkpoint import load_weights, resume_checkpoint, trainable_view
from rlhf_core.training.checkpoint_integrity import CheckpointError, verify_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.guards import NonFiniteError, require_finite_metrics, require_finite_weights
from rlhf_core.training.ppo_step import PPOState, frozen_offload, make_kl_controller, ppo_step, prepare_training
from rlhf_core.training.sampler import PromptSampler
from rlhf_core.training.strategy import StrategyFactory

log = logging.getLogger(__name__)


@dataclass
class PPORunResult:
    """Per-step metrics of the whole run (including steps done before a resume)."""

    history: list[dict[str, float]] = field(default_factory=list)
    resumed_from_step: int = 0


#: Step metrics that must be finite (the scores and KL of the rollouts, the losses and gradient norms).
FINITE_METRICS = ("ppo/scores/raw_mean", "ppo/scores/mean", "ppo/kl/mean", "ppo/rewards/mean", "ppo/policy/loss",
                  "ppo/value/loss", "ppo/policy/grad_norm", "ppo/value/grad_norm")


def _modules(models: PPOModels, config: PPOConfig) -> dict[str, torch.nn.Module]:
    """What a checkpoint stores per role. Under LoRA only the adapter and heads (the frozen base weights are the
    models the run starts from), except that reference refreshes merge the adapter into the policy's base, so
    then the whole policy is stored. A reference with no weights of its own (adapter disabled) stores nothing."""
    refreshes = bool(config.ref_refresh_every)
    modules: dict[str, torch.nn.Module] = {"policy": models.policy if refreshes else trainable_view(models.policy)}
    if models.value_model is not None:  # critic-free estimators have none
        modules["value"] = trainable_view(models.value_model)
    if refreshes and any(True for _ in models.reference.parameters()):
        modules["reference"] = models.reference
    return modules


def train_ppo(
    models: PPOModels,
    prompts: Sequence[Sequence[int]],
    config: PPOConfig,
    n_updates: int,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    on_step: Callable[[PPOStats], None] | None = None,
    init_from: str | os.PathLike[str] | None = None,
    make_strategy: StrategyFactory | None = None,
) -> PPORunResult:
    """Run PPO until ``n_updates`` steps are done, resuming from ``checkpoint_dir/latest`` if present (or from
    the newest earlier checkpoint there that verifies, when that one is damaged: ``resume_checkpoint``).

    ``init_from`` is a checkpoint directory to start from when ``checkpoint_dir`` has none yet: how a
    pipeline iteration continues the previous iteration's run (weights, optimizer, KL controller, cursor)
    while keeping its own checkpoints apart, so rerunning one iteration never sees a later one's state. It has
    no fallback: a damaged ``init_from`` is a :class:`CheckpointError` naming the file.

    A run killed at any point and started again with the same arguments ends with the same weights and
    metrics as an uninterrupted one (same seed, same device), because the optimizer, scheduler, KL
    controller, score statistics, sampler cursor and every RNG are restored. With a ``checkpoint_dir``
    the last step is always checkpointed, whatever ``checkpoint_every`` says. The score statistics
    (``reward.normalize``) restart instead when the scorer is not the one they were estimated with (a promoted
    reward-model refresh between two iterations): :func:`restore_score_moments`.

    ``make_strategy`` builds what applies the gradients (``rlhf_core.distributed.zero.DeepSpeedFactory``: ZeRO over
    several processes, each calling ``train_ppo`` with the same arguments); None = AdamW in this process.
    """
    models, strategy = prepare_training(models, config, make_strategy)
    if config.offload_frozen:
        log.info("ppo.offload_frozen: %s", frozen_offload(models, config).describe())
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(config.seed))
    sampler = PromptSampler(len(prompts), config.prompts_per_update, config.seed)
    result = PPORunResult()
    found = resume_checkpoint(checkpoint_dir, clean=strategy.rank == 0) if checkpoint_dir is not None else None
    verb = "resumed"
    if found is None and init_from is not None:
        found, verb = Path(init_from), "continuing"
        _verify_init_from(found)
    if found is not None:
        saved = strategy.load_checkpoint(found, _modules(models, config), state.generator)
        _restore(saved, state, sampler, result, scorer_identity(models.scorer))
        log.info("%s PPO from %s (step %d)", verb, found, state.step)
    started, first_step = time.monotonic(), state.step
    last_saved = found
    while state.step < n_updates:
        batch = [prompts[i] for i in sampler.next_batch()]
        number = state.step + 1
        try:
            stats = ppo_step(models, strategy, state, batch, config)
            metrics = stats.to_metrics()
            require_finite_metrics(metrics, FINITE_METRICS)
            require_finite_weights(_modules(models, config))
        except NonFiniteError as error:
            kept = f"the last checkpoint ({last_saved}) stays" if last_saved is not None else "nothing was saved"
            raise NonFiniteError(f"PPO step {number}: {error}; training stopped and {kept}. Lower ppo.learning_rate "
                                 "(or check the reward model's scores)") from None
        result.history.append(metrics)
        if on_step is not None:
            on_step(stats)
        if strategy.rank == 0:
            _log_progress(state.step, n_updates, first_step, started, metrics)
        periodic = checkpoint_every > 0 and state.step % checkpoint_every == 0
        if checkpoint_dir is not None and (periodic or state.step == n_updates):
            last_saved = strategy.save_checkpoint(
                checkpoint_dir, state.step, _modules(models, config), state.generator,
                _snapshot(state, sampler, result, scorer_identity(models.scorer)), config.keep_checkpoints,
            )
    return result


def load_checkpoint_weights(
    models: PPOModels, config: PPOConfig, path: str | os.PathLike[str]
) -> dict[str, Any]:
    """The trained weights of a :func:`train_ppo` checkpoint into ``models`` (no optimizer or RNGs: to use the
    result elsewhere, e.g. after DeepSpeed workers trained it); returns its JSON state (``history`` ...).
    The checkpoint is verified against its manifest first (:class:`CheckpointError` when it does not match)."""
    verify_checkpoint(Path(path))
    return load_weights(path, _modules(models, config))


def _verify_init_from(path: Path) -> None:
    """A damaged ``init_from`` stops the run: starting over would silently drop the previous iteration's training."""
    try:
        verify_checkpoint(path)
    except CheckpointError as error:
        raise CheckpointError(f"cannot continue PPO from {path}: {error}; rerun the iteration that wrote it") from None


def _snapshot(state: PPOState, sampler: PromptSampler, result: PPORunResult, scorer: str | None) -> dict[str, Any]:
    """The loop's JSON state; the strategy adds its LR schedule (and writes the optimizer) when saving."""
    return {
        "kl_controller": state.kl_controller.state_dict(),
        "score_moments": state.score_moments.state_dict(),
        "score_moments_scorer": scorer,
        "sampler": sampler.state_dict(),
        "history": result.history,
    }


def _restore(saved: dict[str, Any], state: PPOState, sampler: PromptSampler, result: PPORunResult,
             scorer: str | None) -> None:
    state.step = int(saved["step"])
    state.kl_controller.load_state_dict(saved["kl_controller"])
    restore_score_moments(saved, state.score_moments, scorer)
    sampler.load_state_dict(saved["sampler"])
    result.history = list(saved["history"])
    result.resumed_from_step = state.step


def restore_score_moments(saved: dict[str, Any], moments: RunningMoments, scorer: str | None) -> bool:
    """Load a checkpoint's score moments into ``moments`` unless another scorer's scores estimated them.

    ``scorer`` is the :func:`~rlhf_core.models.scoring.scorer_identity` of this run's scorer; the checkpoint
    records the one its moments came from (``score_moments_scorer``). A new reward model scores on its own scale
    (old ~N(0, 1), new ~N(5, 3)), so the old moments would shift and scale its scores wrongly for many batches:
    the moments start fresh and the first batch normalises by its own statistics. When either identity is unknown
    (a scorer without one, a checkpoint written before they were recorded) the moments are kept. Returns whether
    they were loaded.
    """
    estimated_with = saved.get("score_moments_scorer")
    if scorer is not None and estimated_with is not None and estimated_with != scorer:
        old = saved["score_moments"]
        log.info("score normalisation restarts: the checkpoint's moments (mean %.3f, var %.3f over %d scores) "
                 "come from another reward model (%s, now %s)", old["mean"], old["var"], old["count"],
                 estimated_with, scorer)
        return False
    moments.load_state_dict(saved["score_moments"])
    return True


def _log_progress(step: int, total: int, first_step: int, started: float, metrics: dict[str, float]) -> None:
    elapsed = time.monotonic() - started
    rate = (step - first_step) / elapsed if elapsed > 0 else 0.0
    eta = (total - step) / rate if rate > 0 else float("nan")
    log.info(
        "ppo step %d/%d  score %.3f  kl %.3f  kl_coef %.4f  %.2f steps/s  eta %.0fs",
        step, total, metrics["ppo/scores/mean"], metrics["ppo/kl/mean"], metrics["ppo/kl/coef"], rate, eta,
    )
