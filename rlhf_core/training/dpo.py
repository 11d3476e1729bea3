"""Direct preference optimisation: the policy learns preference pairs offline, against a frozen reference, with
no reward model and no sampling (DPO, Rafailov et al. 2023; IPO, Azar et al. 2023, as an option).

Each side of a pair is encoded exactly as an SFT demonstration (``prompt ids + reply ids + eos``, prompt and padding
labelled ``IGNORE_INDEX``: :mod:`rlhf_core.training.sft`), and its log-probability is the SUM of the next-token
log-probs over the reply tokens and the eos. With ``h = (logp_c - ref_c) - (logp_r - ref_r)``:

    sigmoid:  -log sigmoid(beta * h)
    ipo:      (h - 1 / (2 beta))^2, where (TRL's IPO, ``ipo_per_token``) each reply's log-ratio is first divided
              by its token count, so the target does not depend on reply length

The math is in :mod:`rlhf_core.training.dpo_losses`. A step's loss is the mean over the pairs of the WHOLE batch:
each micro-batch adds its summed pair losses divided by the batch's pair count, so ``micro_batch_size`` never
changes the update. The reference never changes, so its log-probs are computed once, before the first step (TRL's
``precompute_ref_log_probs``); without a separate reference they are the policy's own before training, and no
second copy of the weights is needed. Dropout is off throughout (as in TRL): the policy's log-probs must be
comparable with the reference's. Checkpoints (weights, optimizer, curves) make a killed run resume exactly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import DPOConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.models.lm import dropout_override
from rlhf_core.models.tokenizer import check_stop_and_pad
from rlhf_core.training.checkpoint import resume_checkpoint
from rlhf_core.training.dpo_losses import PreferenceStats, ipo_loss, preference_stats, reply_logprobs, sigmoid_loss
from rlhf_core.training.guards import NonFiniteError, require_finite, require_finite_weights
from rlhf_core.training.sft import IGNORE_INDEX, EncodedExample, LogFn, collate, encode_examples, shuffled_batches
from rlhf_core.training.strategy import Strategy, scheduled_strategy

logger = logging.getLogger(__name__)


def pair_losses(config: DPOConfig, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
    """The configured loss of every pair. logprobs, ref_logprobs, lengths (reply tokens): (B, 2) -> (B,)."""
    if config.loss == "ipo":
        return ipo_loss(logprobs, ref_logprobs, config.beta, lengths if config.ipo_per_token else None)
    return sigmoid_loss(logprobs, ref_logprobs, config.beta)


# --- encoding and forward passes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedPair:
    """Both replies of a pair, each encoded as an SFT demonstration."""

    chosen: EncodedExample
    rejected: EncodedExample


def encode_preferences(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair],
                       max_length: int) -> list[EncodedPair]:
    """``prompt + chosen + eos`` and ``prompt + rejected + eos``, prompt labelled ``IGNORE_INDEX``."""
    chosen = encode_examples(tokenizer, [(p.prompt, p.chosen) for p in pairs], max_length, "dpo.max_length")
    rejected = encode_examples(tokenizer, [(p.prompt, p.rejected) for p in pairs], max_length, "dpo.max_length")
    return [EncodedPair(c, r) for c, r in zip(chosen, rejected, strict=True)]


def pair_logprobs(model: PreTrainedModel, pairs: Sequence[EncodedPair],
                  pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed reply log-probs and reply token counts of both sides, in one forward -> ((B, 2), (B, 2))."""
    device = next(model.parameters()).device
    batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_token_id, device)  # (2B, T)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logprobs = reply_logprobs(logits, batch.labels)  # (2B,)
    lengths = (batch.labels[:, 1:] != IGNORE_INDEX).sum(dim=1).float()  # (2B,)
    n = len(pairs)
    return torch.stack([logprobs[:n], logprobs[n:]], dim=1), torch.stack([lengths[:n], lengths[n:]], dim=1)


@torch.no_grad()
def measure_logprobs(model: PreTrainedModel, pairs: Sequence[EncodedPair], pad_token_id: int,
                     batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pair_logprobs` of every pair, in eval mode, without gradients -> ((N, 2), (N, 2)) on the CPU."""
    was_training = model.training
    model.eval()
    parts = [pair_logprobs(model, pairs[start:start + batch_size], pad_token_id)
             for start in range(0, len(pairs), batch_size)]
    model.train(was_training)
    return torch.cat([p[0] for p in parts]).float().cpu(), torch.cat([p[1] for p in parts]).cpu()


def evaluate_pairs(model: PreTrainedModel, pairs: Sequence[EncodedPair], ref_logprobs: torch.Tensor,
                   config: DPOConfig, pad_token_id: int) -> PreferenceStats:
    """Loss, implicit-reward accuracy and margins of ``model`` on ``pairs`` (reference log-probs (N, 2))."""
    logprobs, lengths = measure_logprobs(model, pairs, pad_token_id, config.eval_batch_size)
    return preference_stats(pair_losses(config, logprobs, ref_logprobs, lengths), logprobs, ref_logprobs, config.beta)


def dpo_step(policy: PreTrainedModel, strategy: Strategy, pairs: Sequence[EncodedPair],
             ref_logprobs: torch.Tensor, config: DPOConfig, pad_token_id: int) -> tuple[PreferenceStats, float]:
    """One optimizer step of ``strategy`` (which trains ``policy``) over ``pairs`` in micro-batches -> (stats before
    the step, pre-clip gradient norm).

    ``ref_logprobs`` (B, 2) are the reference's log-probs of ``pairs``. NonFiniteError, before the step is applied,
    when the loss or the gradient norm is NaN or infinite.
    """
    device = next(policy.parameters()).device
    strategy.zero_grad()
    losses, logprobs = [], []
    for start in range(0, len(pairs), config.micro_batch_size):
        micro = slice(start, start + config.micro_batch_size)
        micro_logprobs, lengths = pair_logprobs(policy, pairs[micro], pad_token_id)
        micro_losses = pair_losses(config, micro_logprobs, ref_logprobs[micro].to(device), lengths)
        # Divided by the WHOLE batch's pair count: micro-batching gives the gradient of one big batch.
        strategy.backward(micro_losses.sum() / len(pairs))
        losses.append(micro_losses.detach().cpu())
        logprobs.append(micro_logprobs.detach().cpu())
    stats = preference_stats(torch.cat(losses), torch.cat(logprobs), ref_logprobs, config.beta)
    require_finite("DPO loss", stats.loss)
    (grad_norm,) = strategy.step()
    return stats, grad_norm


# --- the loop ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DPOResult:
    """Curves and final measurements of one DPO run."""

    train_metrics: tuple[dict[str, float], ...]
    """``dpo/*`` of every optimizer step, in order (the batch's stats before its update)."""
    eval_steps: tuple[int, ...]
    """Step after which each held-out evaluation ran (0 = before training); empty without held-out pairs."""
    eval_metrics: tuple[dict[str, float], ...]
    """``dpo/eval/*`` at each of ``eval_steps``."""
    final_train: dict[str, float]
    """``dpo/train_eval/*``: the final policy on every training pair (before training: loss log 2, accuracy 0.5)."""
    n_truncated: int
    """Training pairs with a side cut to ``max_length``."""
    resumed_from: int
    """Step of the checkpoint this run continued (0 = a fresh start)."""
    seconds: float


@dataclass
class _Run:
    """What the loop carries from step to step (and what a checkpoint saves besides weights and optimizer)."""

    train_metrics: list[dict[str, float]]
    eval_steps: list[int]
    eval_metrics: list[dict[str, float]]

    def state(self) -> dict[str, Any]:
        return {"train_metrics": self.train_metrics, "eval_steps": self.eval_steps, "eval_metrics": self.eval_metrics}


def train_dpo(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_pairs: Sequence[PreferencePair],
    config: DPOConfig = DPOConfig(),
    eval_pairs: Sequence[PreferencePair] = (),
    reference: PreTrainedModel | None = None,
    on_log: LogFn | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
) -> DPOResult:
    """Train ``policy`` in place on ``train_pairs`` against ``reference`` (None = the policy as it is now); ends
    in eval mode.

    ``on_log(step, metrics)`` gets ``dpo/*`` (loss, rewards, log-probs, grad norm, lr, epoch) after every step and
    ``dpo/eval/*`` after every evaluation of ``eval_pairs`` (step 0 = before training). With ``checkpoint_dir``
    a checkpoint is written every ``checkpoint_every`` steps, and calling again with the same arguments (the policy
    loaded afresh at its starting weights: the reference's log-probs are measured before a checkpoint's weights are
    loaded) resumes from the newest one that verifies, ending with the weights an uninterrupted run would have.
    """
    check_stop_and_pad(tokenizer)
    if not train_pairs:
        raise ValueError("DPO needs preference pairs to train on, got none; check the data-prep split")
    started, pad, log = time.perf_counter(), tokenizer.pad_token_id, on_log or (lambda step, metrics: None)
    train = encode_preferences(tokenizer, train_pairs, config.max_length)
    held_out = encode_preferences(tokenizer, eval_pairs, config.max_length) if eval_pairs else []
    plan = batch_plan(len(train), config)
    with dropout_override(policy, 0.0):
        judge = policy if reference is None else reference
        ref_train = measure_logprobs(judge, train, pad, config.eval_batch_size)[0]  # before any step: the reference
        ref_eval = measure_logprobs(judge, held_out, pad, config.eval_batch_size)[0] if held_out else None
        strategy = scheduled_strategy(policy, config, len(plan))
        start, run = _resume(checkpoint_dir, policy, strategy)

        def evaluate(step: int) -> None:
            if ref_eval is not None:
                run.eval_steps.append(step)
                run.eval_metrics.append(evaluate_pairs(policy, held_out, ref_eval, config, pad).to_metrics("dpo/eval"))
                log(step, run.eval_metrics[-1])

        if start == 0:
            evaluate(0)
        resumed_at = time.perf_counter()
        policy.train()
        for step in range(start + 1, len(plan) + 1):
            indices = plan[step - 1]
            stats, metrics = _step(policy, strategy, [train[i] for i in indices], ref_train[indices], config, pad,
                                   step, len(plan))
            run.train_metrics.append(metrics)
            log(step, metrics)
            if config.log_every and (step % config.log_every == 0 or step == len(plan)):
                _log_progress(step, len(plan), stats, step - start, resumed_at)
            if config.eval_every and step % config.eval_every == 0 and step < len(plan):
                evaluate(step)
            if checkpoint_dir is not None and checkpoint_every and step % checkpoint_every == 0 and step < len(plan):
                # The batch plan is drawn whole from the seed, so the generator a checkpoint keeps is not needed.
                strategy.save_checkpoint(checkpoint_dir, step, {"policy": policy}, torch.Generator(), run.state())
        evaluate(len(plan))
        final_train = evaluate_pairs(policy, train, ref_train, config, pad).to_metrics("dpo/train_eval")
    policy.eval()
    require_finite_weights({"DPO policy": policy})  # nothing non-finite is saved, registered or evaluated
    return DPOResult(tuple(run.train_metrics), tuple(run.eval_steps), tuple(run.eval_metrics), final_train,
                     sum(p.chosen.truncated or p.rejected.truncated for p in train), start,
                     time.perf_counter() - started)


def _step(policy: PreTrainedModel, strategy: Strategy, pairs: list[EncodedPair],
          ref_logprobs: torch.Tensor, config: DPOConfig, pad_token_id: int, step: int,
          total_steps: int) -> tuple[PreferenceStats, dict[str, float]]:
    """Step ``step`` of the run at its scheduled learning rate -> (stats, its ``dpo/*`` metrics)."""
    lr = strategy.learning_rate()  # this step's: the strategy moves the schedule on when it steps
    try:
        stats, grad_norm = dpo_step(policy, strategy, pairs, ref_logprobs, config, pad_token_id)
    except NonFiniteError as error:
        raise NonFiniteError(f"DPO step {step}: {error}; training stopped before applying it. Lower "
                             "dpo.learning_rate") from None
    epochs = step / math.ceil(total_steps / config.epochs)
    return stats, {**stats.to_metrics("dpo"), "dpo/grad_norm": grad_norm, "dpo/lr": lr, "dpo/epoch": epochs}


def batch_plan(n_pairs: int, config: DPOConfig) -> list[list[int]]:
    """Pair indices of every step (:func:`rlhf_core.training.sft.shuffled_batches`: drawn whole from the seed, so a
    resumed run takes the same batches as an uninterrupted one)."""
    return shuffled_batches(n_pairs, config.epochs, config.batch_size, config.seed)


def _resume(checkpoint_dir: str | Path | None, policy: PreTrainedModel, strategy: Strategy) -> tuple[int, _Run]:
    """(step, curves so far) of the newest usable checkpoint, its weights, optimizer and schedule loaded; (0, empty)
    if none."""
    path = resume_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    if path is None:
        return 0, _Run([], [], [])
    state = strategy.load_checkpoint(path, {"policy": policy}, torch.Generator())
    logger.info("dpo: resuming from %s (step %d)", path, state["step"])
    return int(state["step"]), _Run(state["train_metrics"], state["eval_steps"], state["eval_metrics"])


def _log_progress(step: int, total: int, stats: PreferenceStats, done: int, since: float) -> None:
    """One progress line: step, loss, reward accuracy and margin, rate (``done`` steps ``since`` then, evaluations
    included) and ETA."""
    rate = done / max(time.perf_counter() - since, 1e-9)
    logger.info("dpo step %d/%d loss %.4f reward accuracy %.3f margin %.3f | %.1f steps/s | eta %.0fs", step, total,
                stats.loss, stats.reward_accuracy, stats.reward_margin, rate, (total - step) / rate)
