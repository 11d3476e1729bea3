"""Supervised fine-tuning on (prompt, reply) demonstrations: the seed policy for PPO.

Each example is ``prompt ids + reply ids + eos``, encoded separately and concatenated, exactly as a rollout
sees them (prompt, then generated continuation). The loss is the token mean of the next-token NLL over the
reply tokens AND the eos token only: prompt and padding positions carry the label ``IGNORE_INDEX``. Training
on the eos token is what teaches the policy to stop. Batches are right padded here, whatever
``tokenizer.padding_side`` says, with an attention mask; GPT-2 position ids count from the left, so right
padding leaves every real token's position unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import SFTConfig
from rlhf_core.models.lm import dropout_override
from rlhf_core.models.tokenizer import check_stop_and_pad
from rlhf_core.training.guards import NonFiniteError, require_finite, require_finite_weights
from rlhf_core.training.strategy import Strategy, scheduled_strategy

logger = logging.getLogger(__name__)

#: Label of a position that takes no part in the loss (prompt and padding); the value torch and HF use.
IGNORE_INDEX = -100

#: One demonstration: (prompt, reply). The reply is the continuation, usually starting with a space.
Demonstration = tuple[str, str]
#: ``on_log(step, metrics)``: called after every step (train metrics) and every evaluation (eval metrics).
LogFn = Callable[[int, dict[str, float]], None]


@dataclass(frozen=True)
class EncodedExample:
    """One tokenised demonstration (lists, unpadded)."""

    input_ids: list[int]
    """prompt ids + reply ids + eos."""
    labels: list[int]
    """``IGNORE_INDEX`` on the prompt, the ids themselves on reply + eos."""
    truncated: bool
    """True when the demonstration was cut to ``max_length``."""


@dataclass(frozen=True)
class SFTBatch:
    """A right-padded batch. All tensors (B, T)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


@dataclass(frozen=True)
class SFTResult:
    """Loss curves of one SFT run."""

    train_losses: tuple[float, ...]
    """Reply-token mean loss of each optimizer step, in order."""
    eval_steps: tuple[int, ...]
    """Step after which each evaluation ran (0 = before training)."""
    eval_losses: tuple[float, ...]
    """Held-out reply-token mean loss at each of ``eval_steps``."""
    seconds: float
    """Wall time of the run, evaluations included."""

    @property
    def initial_eval_loss(self) -> float:
        """Held-out loss before the first step."""
        return self.eval_losses[0]

    @property
    def final_eval_loss(self) -> float:
        """Held-out loss after the last step."""
        return self.eval_losses[-1]


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Demonstration], max_length: int,
    setting: str = "sft.max_length",
) -> list[EncodedExample]:
    """Tokenise prompts and replies separately and join them as ``prompt + reply + eos``.

    Too-long examples keep the END of the prompt (nearest the reply) and the START of the reply, with at
    least one prompt token left when the prompt has any; the eos is then lost, so a warning is logged, naming
    ``setting`` (the config key of ``max_length``: DPO encodes its pairs' replies here too).
    """
    prompts = tokenizer([p for p, _ in examples], add_special_tokens=False).input_ids
    replies = tokenizer([r for _, r in examples], add_special_tokens=False).input_ids
    encoded = []
    for prompt_ids, reply_ids in zip(prompts, replies):
        reply_ids = reply_ids + [tokenizer.eos_token_id]
        truncated = len(prompt_ids) + len(reply_ids) > max_length
        reply_ids = reply_ids[: max_length - min(1, len(prompt_ids))]
        if truncated:
            prompt_ids = prompt_ids[len(prompt_ids) - (max_length - len(reply_ids)) :]
        labels = [IGNORE_INDEX] * len(prompt_ids) + reply_ids
        encoded.append(EncodedExample(prompt_ids + reply_ids, labels, truncated))
    n_truncated = sum(e.truncated for e in encoded)
    if n_truncated:
        logger.warning(
            "%d of %d (prompt, reply) examples exceed max_length=%d tokens and were truncated; raise %s "
            "or filter long rows in data-prep", n_truncated, len(encoded), max_length, setting
        )
    return encoded


def collate(
    examples: Sequence[EncodedExample], pad_token_id: int, device: torch.device | str = "cpu"
) -> SFTBatch:
    """Right-pad to the longest example: pad id, attention 0 and label ``IGNORE_INDEX`` on padding."""
    shape = (len(examples), max(len(e.input_ids) for e in examples))
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros(shape, dtype=torch.long)  # (B, T)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)  # (B, T)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(example.labels)
    return SFTBatch(input_ids.to(device), attention_mask.to(device), labels.to(device))


def reply_token_loss(model: PreTrainedModel, batch: SFTBatch) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over labelled positions, and how many there are: (scalar, count)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    # logits[:, t] predicts the token at t + 1; the first token has no prediction.
    logits = logits[:, :-1].float()  # (B, T-1, V)
    targets = batch.labels[:, 1:]  # (B, T-1)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, int((targets != IGNORE_INDEX).sum())


def eval_loss(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Demonstration],
    max_length: int = 128,
    batch_size: int = 64,
) -> float:
    """Token-mean NLL of the replies (and eos) given their prompts, over all ``examples``."""
    encoded = encode_examples(tokenizer, examples, max_length)
    return _eval_encoded(model, encoded, tokenizer.pad_token_id, batch_size)


def _eval_encoded(
    model: PreTrainedModel, examples: Sequence[EncodedExample], pad_token_id: int, batch_size: int
) -> float:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start : start + batch_size], pad_token_id, device)
            loss_sum, n = reply_token_loss(model, batch)
            total, count = total + float(loss_sum), count + n
    model.train(was_training)
    return total / max(count, 1)


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_examples: Sequence[Demonstration],
    eval_examples: Sequence[Demonstration],
    config: SFTConfig = SFTConfig(),
    on_log: LogFn | None = None,
) -> SFTResult:
    """Fine-tune ``model`` in place on ``train_examples``, evaluating on ``eval_examples``; ends in eval mode.

    ``on_log(step, metrics)`` receives ``sft/train_loss``, ``sft/lr``, ``sft/grad_norm``, ``sft/epoch`` after
    every step and ``sft/eval_loss`` after every evaluation (step 0 = before training).
    """
    check_stop_and_pad(tokenizer)
    if not train_examples or not eval_examples:
        raise ValueError(
            f"SFT needs demonstrations for training and evaluation, got {len(train_examples)} train and "
            f"{len(eval_examples)} eval; check the data-prep split"
        )
    started = time.perf_counter()
    train = encode_examples(tokenizer, train_examples, config.max_length)
    held_out = encode_examples(tokenizer, eval_examples, config.max_length)
    log = on_log or (lambda step, metrics: None)
    steps_per_epoch = math.ceil(len(train) / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    strategy = scheduled_strategy(model, config, total_steps)
    eval_steps, eval_losses, train_losses = [], [], []

    def evaluate(step: int) -> None:
        eval_steps.append(step)
        eval_losses.append(_eval_encoded(model, held_out, tokenizer.pad_token_id, config.eval_batch_size))
        log(step, {"sft/eval_loss": eval_losses[-1]})

    torch.manual_seed(config.seed)
    evaluate(0)
    plan = shuffled_batches(len(train), config.epochs, config.batch_size, config.seed)
    with dropout_override(model, config.dropout):
        for step, indices in enumerate(plan, start=1):
            batch = [train[i] for i in indices]
            model.train()
            lr = strategy.learning_rate()  # this step's: the strategy moves the schedule on when it steps
            try:
                loss, grad_norm = _train_step(model, strategy, batch, config, tokenizer.pad_token_id)
            except NonFiniteError as error:
                raise NonFiniteError(f"SFT step {step}: {error}; training stopped before applying it. Lower "
                                     "sft.learning_rate") from None
            train_losses.append(loss)
            epoch = step / steps_per_epoch
            log(step, {"sft/train_loss": loss, "sft/lr": lr, "sft/grad_norm": grad_norm, "sft/epoch": epoch})
            if config.log_every and (step % config.log_every == 0 or step == total_steps):
                _log_progress(step, total_steps, loss, started)
            if config.eval_every and step % config.eval_every == 0 and step < total_steps:
                evaluate(step)
    evaluate(total_steps)
    model.eval()
    require_finite_weights({"SFT policy": model})  # nothing non-finite is saved, registered or evaluated
    seconds = time.perf_counter() - started
    return SFTResult(tuple(train_losses), tuple(eval_steps), tuple(eval_losses), seconds)


def shuffled_batches(n_items: int, epochs: int, batch_size: int, seed: int) -> list[list[int]]:
    """Item indices of every optimizer step: each epoch a fresh shuffle (one generator seeded with ``seed``) cut
    into ``batch_size`` chunks, the last one possibly smaller. Drawn whole up front, so a resumed run takes the same
    batches as an uninterrupted one (DPO, SFT)."""
    shuffler = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(epochs):
        order = torch.randperm(n_items, generator=shuffler).tolist()
        plan += [order[start:start + batch_size] for start in range(0, n_items, batch_size)]
    return plan


def _train_step(
    model: PreTrainedModel, strategy: Strategy, examples: list[EncodedExample], config: SFTConfig, pad_token_id: int,
) -> tuple[float, float]:
    """One optimizer step of ``strategy`` (which trains ``model``) over ``examples`` in micro-batches -> (token-mean
    loss, pre-clip grad norm)."""
    device = next(model.parameters()).device
    # Divide by the tokens of the WHOLE batch so micro-batching gives the same gradient as one big batch.
    n_tokens = max(sum(sum(label != IGNORE_INDEX for label in e.labels[1:]) for e in examples), 1)
    strategy.zero_grad()
    total = 0.0
    for start in range(0, len(examples), config.micro_batch_size):
        batch = collate(examples[start : start + config.micro_batch_size], pad_token_id, device)
        loss_sum, _ = reply_token_loss(model, batch)
        strategy.backward(loss_sum / n_tokens)
        total += float(loss_sum.detach())
    require_finite("SFT loss", total / n_tokens)
    (grad_norm,) = strategy.step()
    return total / n_tokens, grad_norm


def _log_progress(step: int, total: int, loss: float, started: float) -> None:
    """One progress line: step, loss, rate and ETA (the rate includes evaluations so far)."""
    rate = step / max(time.perf_counter() - started, 1e-9)
    eta = (total - step) / rate
    logger.info("sft step %d/%d loss %.4f | %.1f steps/s | eta %.0fs", step, total, loss, rate, eta)
