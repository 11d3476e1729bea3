"""Bradley-Terry reward-model training and evaluation on (prompt, chosen, rejected) pairs."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.models.budget import pair_chunks, pair_lengths, packs_scores, same_count, token_chunks
from rlhf_core.models.lora import add_training_adapter, merge_adapter
from rlhf_core.models.memory import autocast, enable_gradient_checkpointing
from rlhf_core.models.families import score_prefix
from rlhf_core.models.roles import disable_dropout, keep_in_float32, score_head, sequence_scores
from rlhf_core.models.text import encode_pair, keep_tail, pad_id, right_pad
from rlhf_core.ppo.losses import bradley_terry_loss
from rlhf_core.ppo.pairwise import pairwise_accuracy, pairwise_wins
from rlhf_core.training.guards import NonFiniteError, require_finite_weights
from rlhf_core.training.strategy import (Strategy, StrategyFactory, TrainableGroup, local_strategy, refuse_non_finite,
                                         schedule, weighted_shard)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodedPairs:
    """Token ids of every pair, ready for batching."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: list[float]
    n_truncated: int
    """Pairs where either side was cut to ``max_length`` (kept from the end)."""


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair], max_length: int, prefix: Sequence[int] = ()
) -> EncodedPairs:
    """Tokenize each pair as ``prefix + prompt + response + eos`` on both sides. ``prefix``: what the reward model's
    input starts with (``families.score_prefix``: an encoder's ``[CLS]``, nothing for a decoder)."""
    chosen, rejected, margins, n_cut = [], [], [], 0
    for pair in pairs:
        c, cut_c = keep_tail(encode_pair(tokenizer, pair.prompt, pair.chosen), max_length, prefix)
        r, cut_r = keep_tail(encode_pair(tokenizer, pair.prompt, pair.rejected), max_length, prefix)
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
    """Fraction of pairs with s_chosen > s_rejected, ties counting half (``ppo.pairwise.pairwise_accuracy``)."""
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
    best_epoch: int | None = None
    """With ``select_best_epoch``: the epoch whose weights were kept (0 = the weights before training)."""

    @property
    def final_eval(self) -> RewardEval | None:
        """The last evaluation, if any."""
        return self.evals[-1][1] if self.evals else None


class SequenceScorer(nn.Module):
    """:func:`~rlhf_core.models.roles.sequence_scores` of a reward model as a module of its own.

    The training forward goes through this module so that a training engine (DeepSpeed) can wrap all of it;
    it holds no weights of its own.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T), (B, T) -> (B,) scores at each row's last real token."""
        return sequence_scores(self.model, input_ids, attention_mask)


def _pair_scores(
    scorer: nn.Module, chosen: list[list[int]], rejected: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of both sides in one forward pass of a :class:`SequenceScorer` (or its engine). -> ((B,), (B,))."""
    device = next(scorer.parameters()).device
    ids, mask = right_pad(chosen + rejected, pad)  # (2B, T)
    scores = scorer(ids.to(device), mask.to(device))
    return scores[: len(chosen)], scores[len(chosen) :]


@torch.no_grad()
def score_pairs(model: PreTrainedModel, chosen: Sequence[list[int]], rejected: Sequence[list[int]], pad: int,
                batch_size: int = 32, max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every chosen and every rejected row, in pair order, both sides of a chunk of pairs
    (``budget.pair_chunks``) in one forward. -> ((N,), (N,)) float32 on the model's device."""
    scorer = SequenceScorer(model)
    parts = [_pair_scores(scorer, list(chosen[c.start:c.stop]), list(rejected[c.start:c.stop]), pad)
             for c in pair_chunks(model, chosen, rejected, batch_size, max_tokens)]
    if not parts:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat([c for c, _ in parts]).float(), torch.cat([r for _, r in parts]).float()


@torch.no_grad()
def evaluate_reward_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, encoded: EncodedPairs, batch_size: int = 32,
    max_tokens: int | None = None,
) -> RewardEval:
    """Loss, accuracy, margin and score statistics on encoded pairs, ``batch_size`` pairs (and at most
    ``max_tokens`` tokens) per forward."""
    if not encoded.chosen:
        raise ValueError("evaluate_reward_model got no pairs; the held-out split is empty")
    was_training = model.training
    model.eval()
    chosen, rejected = score_pairs(model, encoded.chosen, encoded.rejected, pad_id(tokenizer), batch_size, max_tokens)
    model.train(was_training)
    diff = chosen - rejected
    both = torch.cat([chosen, rejected])
    return RewardEval(
        loss=float(bradley_terry_loss(chosen, rejected)),
        accuracy=pairwise_accuracy(chosen, rejected),
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
    make_strategy: StrategyFactory | None = None,
) -> RewardTrainingResult:
    """Train ``model`` in place with the Bradley-Terry loss; evaluate every ``eval_every`` steps and at the end.

    ``on_log(step, metrics)`` receives ``rm/train/loss``, ``rm/train/accuracy``, ``rm/train/grad_norm`` (before
    clipping), ``rm/train/lr`` (the step's, ``config.warmup_steps`` and ``config.lr_schedule``) each step and
    ``rm/eval/*`` at each evaluation, so the caller can print progress and log to a tracker.
    ``make_strategy`` builds what applies the gradients (``rlhf_core.distributed.zero.DeepSpeedFactory``: ZeRO over
    several processes, each passing the same pairs and training on its share of every batch); None = AdamW here.
    """
    if not train_pairs:
        raise ValueError("train_reward_model got no training pairs")
    if config.select_best_epoch and (not eval_pairs or make_strategy is not None):
        raise ValueError("select_best_epoch needs eval pairs to select on and runs in one process (no make_strategy)")
    started = time.monotonic()
    torch.manual_seed(config.seed)
    disable_dropout(model).train()
    heads = score_head(model)
    dtype = next(heads[0].parameters()).dtype
    for head in heads:
        keep_in_float32(head)  # in bf16 its small updates would round away; back to the model's dtype at the end
    adapter = add_training_adapter(model, config.lora, config.seed) if config.lora.enabled else None
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    prefix = score_prefix(model, tokenizer)
    train = encode_pairs(tokenizer, train_pairs, config.max_length, prefix)
    held_out = encode_pairs(tokenizer, eval_pairs, config.max_length, prefix) if eval_pairs else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    group = TrainableGroup(SequenceScorer(model), trainable, config.learning_rate)
    total_steps = config.epochs * math.ceil(len(train_pairs) / config.batch_size)
    strategy = (make_strategy or local_strategy)([group], config.weight_decay, config.max_grad_norm,
                                                 schedule(config, total_steps))
    (scorer,) = strategy.modules
    packed = packs_scores(model)
    result = RewardTrainingResult(n_truncated=train.n_truncated)
    order = list(range(len(train.chosen)))
    rng = random.Random(config.seed)
    step = 0

    def evaluate_unless_done() -> None:
        """Evaluate at ``step`` (and log it) unless the last evaluation was already there."""
        if not result.evals or result.evals[-1][0] != step:
            evaluation = _record_eval(model, tokenizer, held_out, step, result, config)
            if on_log is not None:
                on_log(step, evaluation)

    best = _BestEpoch() if config.select_best_epoch else None
    if best is not None:
        evaluate_unless_done()
        best.consider(0, result.evals[-1][1], model)
    for epoch in range(1, config.epochs + 1):
        rng.shuffle(order)
        for start in range(0, len(order), config.batch_size):
            try:
                metrics = _train_step(scorer, tokenizer, train, order[start : start + config.batch_size], strategy,
                                      config, packed)
            except NonFiniteError as error:
                raise NonFiniteError(f"reward-model step {step + 1}: {error}; training stopped before applying it. "
                                     "Lower the learning rate") from None
            step += 1
            result.train_loss.append(metrics["rm/train/loss"])
            result.train_accuracy.append(metrics["rm/train/accuracy"])
            if eval_every and held_out is not None and step % eval_every == 0:
                metrics.update(_record_eval(model, tokenizer, held_out, step, result, config))
            if on_log is not None:
                on_log(step, metrics)
        if best is not None:
            evaluate_unless_done()
            best.consider(epoch, result.evals[-1][1], model)
    if held_out is not None:
        evaluate_unless_done()
    if best is not None:
        result.best_epoch = best.restore(model, config.epochs)
        result.evals.append((step, best.evaluation))  # final_eval describes the weights returned
    if adapter is not None:
        merge_adapter(adapter)  # a plain classifier again, which the caller saves and scores as before
    for head in heads:
        head.to(dtype)  # one dtype, the model's, as it is saved and loaded again
    model.eval()
    require_finite_weights({"reward model": model})  # nothing non-finite is saved, registered or scores
    result.seconds = time.monotonic() - started
    return result


class _BestEpoch:
    """The weights (a CPU copy) and evaluation of the epoch with the lowest eval loss so far."""

    def __init__(self) -> None:
        self.epoch = -1
        self.evaluation: RewardEval | None = None
        self.state: dict[str, torch.Tensor] = {}

    def consider(self, epoch: int, evaluation: RewardEval, model: nn.Module) -> None:
        if self.evaluation is None or evaluation.loss < self.evaluation.loss:
            self.epoch, self.evaluation = epoch, evaluation
            self.state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def restore(self, model: nn.Module, last_epoch: int) -> int:
        """Load the kept weights into ``model`` unless they are the last epoch's; returns the kept epoch."""
        if self.epoch != last_epoch:
            model.load_state_dict(self.state)
            log.info("reward model: kept epoch %d of %d (eval loss %.4f, accuracy %.3f: the lowest loss)",
                     self.epoch, last_epoch, self.evaluation.loss, self.evaluation.accuracy)
        self.state = {}
        return self.epoch


def _train_step(
    scorer: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: EncodedPairs,
    batch: list[int],
    strategy: Strategy,
    config: RewardTrainingConfig,
    packed: bool = False,
) -> dict[str, float]:
    """One optimizer step on this rank's share of ``batch``; returns the loss and accuracy over all of it.

    The share goes through the model in micro-batches (:func:`_micro_batches`: at most ``config.micro_batch_size``
    pairs and ``config.max_tokens_per_forward`` tokens, so of unequal sizes); each backpropagates its part of the
    share's mean loss (its pairs' summed loss, margin and centring terms included, over the share's size), so the
    accumulated gradient is the whole share's, whatever the micro-batches.
    """
    mine, weight = weighted_shard(batch, strategy.rank, strategy.world_size)
    device = next(scorer.parameters()).device
    strategy.zero_grad()
    loss_sum, correct = 0.0, 0.0
    for part, counted in _micro_batches(data, batch, strategy, config, packed):
        share = len(part) / len(mine) if counted else 0.0
        with autocast(config.autocast, device):
            chosen, rejected = _pair_scores(
                scorer, [data.chosen[i] for i in part], [data.rejected[i] for i in part], pad_id(tokenizer)
            )
        margin = torch.tensor([data.margins[i] for i in part], device=chosen.device) if config.use_margin else None
        loss = bradley_terry_loss(chosen, rejected, margin)
        if config.center_rewards_coef is not None:
            loss = loss + config.center_rewards_coef * ((chosen + rejected) ** 2).mean()
        refuse_non_finite(strategy, "reward-model loss", float(loss.detach()))
        strategy.backward(loss * share * weight)  # its part of the share's mean
        if counted:
            loss_sum += float(loss.detach()) * len(part)
            correct += float(pairwise_wins(chosen, rejected).sum()) if weight else 0.0
    lr = strategy.learning_rate()  # this step's: the strategy moves the schedule on when it steps
    (grad_norm,) = strategy.step()
    n = float(len(mine)) if weight else 0.0  # a rank that only kept its collectives running counts nothing
    sums = strategy.all_sum({"loss": loss_sum if n else 0.0, "correct": correct, "n": n})
    return {"rm/train/loss": sums["loss"] / sums["n"], "rm/train/accuracy": sums["correct"] / sums["n"],
            "rm/train/grad_norm": grad_norm, "rm/train/lr": lr}


def _micro_batches(data: EncodedPairs, batch: list[int], strategy: Strategy, config: RewardTrainingConfig,
                   packed: bool) -> list[tuple[list[int], bool]]:
    """This rank's share of ``batch`` as micro-batches ``(pair indices, counted)``, consecutive and in order.

    Every rank runs as many as the rank that needs most (ZeRO-3's forwards are collective, ``budget.same_count``): a
    share splits further, and one too small to split that far repeats its first pair, not counted (weight 0).
    """
    def plan(share: Sequence[int]) -> list[range]:
        lengths = pair_lengths([data.chosen[i] for i in share], [data.rejected[i] for i in share], packed)
        return token_chunks(lengths, config.micro_batch_size or len(share), config.max_tokens_per_forward, packed)

    world = strategy.world_size
    plans = [plan(weighted_shard(batch, rank, world)[0]) for rank in range(world)]
    mine = weighted_shard(batch, strategy.rank, world)[0]
    return [([mine[i] for i in chunk], counted) for chunk, counted in same_count(plans, strategy.rank)]


def _record_eval(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, held_out: EncodedPairs, step: int,
    result: RewardTrainingResult, config: RewardTrainingConfig,
) -> dict[str, float]:
    """Every rank evaluates all held-out pairs: the same forwards everywhere (ZeRO-3 gathers are collective)."""
    with autocast(config.autocast, next(model.parameters()).device):
        evaluation = evaluate_reward_model(model, tokenizer, held_out, config.micro_batch_size or 32,
                                           config.max_tokens_per_forward)
    result.evals.append((step, evaluation))
    log.info("reward model step %d: held-out accuracy %.3f, loss %.4f", step, evaluation.accuracy, evaluation.loss)
    return {f"rm/eval/{k}": float(v) for k, v in asdict(evaluation).items()}
