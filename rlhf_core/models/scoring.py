"""Reward sources: a reward model (same or different tokenizer), rule functions, weighted sums.

Every scorer maps a :class:`Rollout` to one score per sequence, shape (B,).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.roles import sequence_scores
from rlhf_core.models.text import keep_tail, pad_id, right_pad, same_vocabulary
from rlhf_core.training.rollout import Rollout


class Scorer(Protocol):
    """Anything that scores a batch of rollouts: (B, ...) -> (B,)."""

    def __call__(self, rollout: Rollout) -> torch.Tensor: ...


def decode_rollout(rollout: Rollout, tokenizer: PreTrainedTokenizerBase) -> tuple[list[str], list[str]]:
    """Prompt and response texts of each row, special tokens (pad, eos) removed."""
    prompts, responses = [], []
    for row in range(rollout.query_ids.shape[0]):
        prompts.append(tokenizer.decode(rollout.query_ids[row][rollout.query_mask[row]], skip_special_tokens=True))
        responses.append(
            tokenizer.decode(rollout.response_ids[row][rollout.response_mask[row]], skip_special_tokens=True)
        )
    return prompts, responses


class RewardModelScorer:
    """Scores with a frozen sequence-classification reward model at the last real token.

    With the policy's tokenizer the ids are used as they are; with a different tokenizer the text is
    decoded and re-tokenized (eos appended only for responses that stopped).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy_tokenizer: PreTrainedTokenizerBase,
        rm_tokenizer: PreTrainedTokenizerBase | None = None,
        max_length: int = 1024,
        batch_size: int = 32,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.policy_tokenizer = policy_tokenizer
        self.rm_tokenizer = rm_tokenizer or policy_tokenizer
        self.retokenize = not same_vocabulary(policy_tokenizer, self.rm_tokenizer)
        self.max_length = max_length
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, rollout: Rollout) -> torch.Tensor:
        scores = []
        for start in range(0, rollout.query_ids.shape[0], self.batch_size):
            chunk = rollout.select(slice(start, start + self.batch_size))
            ids, mask = self._retokenized(chunk) if self.retokenize else (chunk.input_ids, chunk.attention_mask)
            scores.append(sequence_scores(self.model, ids, mask))
        return torch.cat(scores)

    def _retokenized(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        prompts, responses = decode_rollout(rollout, self.policy_tokenizer)
        tok = self.rm_tokenizer
        rows = []
        for prompt, response, stopped in zip(prompts, responses, rollout.stopped.tolist(), strict=True):
            ids = tok(prompt, add_special_tokens=False)["input_ids"] + tok(response, add_special_tokens=False)["input_ids"]
            if stopped and tok.eos_token_id is not None:
                ids.append(tok.eos_token_id)
            rows.append(keep_tail(ids, self.max_length)[0])
        ids, mask = right_pad(rows, pad_id(tok))
        return ids.to(rollout.query_ids.device), mask.to(rollout.query_ids.device)


class TextRewardFunction:
    """A rule-based reward on decoded text: ``fn(prompts, responses) -> one float per row``."""

    def __init__(
        self, fn: Callable[[list[str], list[str]], Sequence[float]], tokenizer: PreTrainedTokenizerBase
    ) -> None:
        self.fn = fn
        self.tokenizer = tokenizer

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        prompts, responses = decode_rollout(rollout, self.tokenizer)
        values = list(self.fn(prompts, responses))
        if len(values) != len(prompts):
            raise ValueError(f"reward function returned {len(values)} scores for {len(prompts)} responses")
        return torch.tensor(values, dtype=torch.float32)


class WeightedSum:
    """Several reward sources combined: ``sum_i w_i * scorer_i(rollout)``."""

    def __init__(self, parts: Sequence[tuple[Scorer, float]]) -> None:
        if not parts:
            raise ValueError("WeightedSum needs at least one (scorer, weight) pair")
        self.parts = list(parts)

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        return sum(weight * scorer(rollout).float() for scorer, weight in self.parts)
