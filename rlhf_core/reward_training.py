"""Bradley-Terry reward-model training and evaluation on (prompt, chosen, rejected) pairs."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.losses import bradley_terry_loss
from rlhf_core.models import disable_dropout, sequence_scores
from rlhf_core.text import encode_pair, keep_tail, pad_id, right_pad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferencePair:
    """One human (or simulated) judgement: ``chosen`` was preferred to ``rejected`` for ``prompt``."""

    prompt: str
    chosen: str
    rejected: str
    margin: float | None = None


@dataclass(frozen=True)
class EncodedPairs:
    """Token ids of every pair, ready for batching."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: list[float]
    n_truncated: int
    """Pairs where either side was cut to ``max_length`` (kept from the end)."""


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair], max_length: int
) -> EncodedPairs:
    """Tokenize each pair as ``prompt + response + eos`` on both sides."""
    chosen, rejected, margins, n_cut = [], [], [], 0
    for pair in pairs:
        c, cut_c = keep_tail(encode_pair(tokenizer, pair.prompt, pair.chosen), max_length)
        r, cut_r = keep_tail(encode_pair(tokenizer, pair.prompt, pair.rejected), max_length)
        chosen.append(c)
        rejected.append(r)
        margins.append(0.0 if pair.margin is None or math.isnan(pair.margin) else float(pair.margin))
        n_cut += int(cut_c or cut_r)
    return EncodedPairs(chosen, rejected, margins, n_cut)


@dataclass(frozen=True)
class RewardEval:
    """Held-out metrics of a reward model on preference pairs."""

    loss: float
    accuracy: float
    """Fraction of pairs with s_chosen > s_rejected (ties count half)."""
    margin_mean: float
    """Mean of s_chosen - s_rejected."""
    score_mean: float
    score_std: float
    n_pairs: int


@dataclass
class RewardTrainingResult:
    """Per-step training curve and evaluations."""

    train_loss: list[float] = field(default_factory=list)
    train_accuracy: list[float] = field(default_factory=list)
    evals: list[tuple[int, RewardEval]] = field(default_factory=list)
    n_truncated: int = 0
    seconds: float = 0.0

    @property
    def final_eval(self) -> RewardEval | None:
        """The last evaluation, if any."""
        return self.evals[-1][1] if self.evals else None


def _pair_scores(
    model: PreTrainedModel, chosen: list[list[int]], rejected: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of both sides in one forward pass. -> ((B,), (B,))."""
    device = next(model.parameters()).device
    ids, mask = right_pad(chosen + rejected, pad)  # (2B, T)
    scores = sequence_scores(model, ids.to(device), mask.to(device))
    return scores[: len(chosen)], scores[len(chosen) :]


@torch.no_grad()
def evaluate_reward_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, encoded: EncodedPairs, batch_size: int = 32
) -> RewardEval:
    """Loss, accuracy, margin and score statistics on encoded pairs."""
    if not encoded.chosen:
        raise ValueError("evaluate_reward_model got no pairs; the held-out split is empty")
    was_training = model.training
    model.eval()
    chosen_all, rejected_all = [], []
    for start in range(0, len(encoded.chosen), batch_size):
        c, r = _pair_scores(
            model, encoded.chosen[start : start + batch_size], encoded.rejected[start : start + batch_size], pad_id(tokenizer)
        )
        chosen_all.append(c)
        rejected_all.append(r)
    model.train(was_training)
    chosen, rejected = torch.cat(chosen_all), torch.cat(rejected_all)
    diff = chosen - rejected
    both = torch.cat([chosen, rejected])
    return RewardEval(
        loss=float(bradley_terry_loss(chosen, rejected)),
        accuracy=float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean()),
        margin_mean=float(diff.mean()),
        score_mean=float(both.mean()),
        score_std=float(both.std(unbiased=False)),
        n_pairs=len(encoded.chosen),
    )


def train_reward_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_pairs: Sequence[PreferencePair],
    eval_pairs: Sequence[PreferencePair],
    config: RewardTrainingConfig,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
    eval_every: int = 0,
) -> RewardTrainingResult:
    """Train ``model`` in place with the Bradley-Terry loss; evaluate every ``eval_every`` steps and at the end.

    ``on_log(step, metrics)`` receives ``rm/train/loss``, ``rm/train/accuracy`` each step and
    ``rm/eval/*`` at each evaluation, so the caller can print progress and log to a tracker.
    """
    if not train_pairs:
        raise ValueError("train_reward_model got no training pairs")
    started = time.monotonic()
    torch.manual_seed(config.seed)
    disable_dropout(model).train()
    train = encode_pairs(tokenizer, train_pairs, config.max_length)
    held_out = encode_pairs(tokenizer, eval_pairs, config.max_length) if eval_pairs else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    result = RewardTrainingResult(n_truncated=train.n_truncated)
    order = list(range(len(train.chosen)))
    rng = random.Random(config.seed)
    step = 0
    for _ in range(config.epochs):
        rng.shuffle(order)
        for start in range(0, len(order), config.batch_size):
            metrics = _train_step(model, tokenizer, train, order[start : start + config.batch_size], optimizer, config)
            step += 1
            result.train_loss.append(metrics["rm/train/loss"])
            result.train_accuracy.append(metrics["rm/train/accuracy"])
            if eval_every and held_out is not None and step % eval_every == 0:
                metrics.update(_record_eval(model, tokenizer, held_out, step, result))
            if on_log is not None:
                on_log(step, metrics)
    if held_out is not None and (not result.evals or result.evals[-1][0] != step):
        final = _record_eval(model, tokenizer, held_out, step, result)
        if on_log is not None:
            on_log(step, final)
    model.eval()
    result.seconds = time.monotonic() - started
    return result


def _train_step(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: EncodedPairs,
    batch: list[int],
    optimizer: torch.optim.Optimizer,
    config: RewardTrainingConfig,
) -> dict[str, float]:
    chosen, rejected = _pair_scores(
        model, [data.chosen[i] for i in batch], [data.rejected[i] for i in batch], pad_id(tokenizer)
    )
    margin = torch.tensor([data.margins[i] for i in batch], device=chosen.device) if config.use_margin else None
    loss = bradley_terry_loss(chosen, rejected, margin)
    if config.center_rewards_coef is not None:
        loss = loss + config.center_rewards_coef * ((chosen + rejected) ** 2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    return {"rm/train/loss": float(loss.detach()), "rm/train/accuracy": float((chosen > rejected).float().mean())}


def _record_eval(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, held_out: EncodedPairs, step: int, result: RewardTrainingResult
) -> dict[str, float]:
    evaluation = evaluate_reward_model(model, tokenizer, held_out)
    result.evals.append((step, evaluation))
    log.info("reward model step %d: held-out accuracy %.3f, loss %.4f", step, evaluation.accuracy, evaluation.loss)
    return {f"rm/eval/{k}": float(v) for k, v in asdict(evaluation).items()}
