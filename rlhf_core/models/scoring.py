"""Reward sources: a reward model (same or different tokenizer), an ensemble of them, rule functions, weighted sums.

Every scorer maps a :class:`Rollout` to one score per sequence, shape (B,).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.budget import packs_scores, row_chunks, token_chunks
from rlhf_core.models.families import max_positions, score_prefix
from rlhf_core.models.roles import sequence_scores
from rlhf_core.models.sequences import Rollout
from rlhf_core.models.text import keep_tail, pad_id, right_pad, same_vocabulary
from rlhf_core.ppo.rewards import ENSEMBLE_AGGREGATIONS, EnsembleAggregation, aggregate_members


class Scorer(Protocol):
    """Anything that scores a batch of rollouts: (B, ...) -> (B,).

    A scorer may also have ``identity() -> str``: the same for two scorers that score alike, different when they
    do not (:func:`scorer_identity`). Statistics estimated from its scores (the normalisation moments) are kept
    only while the identity stays the same.
    """

    def __call__(self, rollout: Rollout) -> torch.Tensor: ...


def scorer_identity(scorer: Scorer) -> str | None:
    """``scorer.identity()``, or None for a scorer that has none (then nothing can tell whether it changed)."""
    identity = getattr(scorer, "identity", None)
    return identity() if callable(identity) else None


#: Values hashed per tensor by :func:`weights_digest`.
DIGEST_SAMPLE = 4096


def weights_digest(model: nn.Module, sample: int = DIGEST_SAMPLE) -> str:
    """A short digest of a model's weights: every parameter's name, shape, dtype and first ``sample`` values.

    Cheap on a large model on a GPU (a few KB per tensor leave the device) and enough to tell two trained
    reward models apart: training moves the score head and every adapted or fine-tuned matrix, and a merged
    LoRA update is dense. The same weights give the same digest on any device and in any process.
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        head = param.detach().reshape(-1)[:sample].contiguous().cpu()
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        digest.update(head.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


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
    """Scores with a frozen sequence-classification reward model (decoder or encoder; ``roles.sequence_scores``).

    A decoder with the policy's tokenizer takes the rollout's ids as they are. With a different tokenizer the text is
    decoded and re-tokenized (eos appended only for responses that stopped); an encoder's rows are laid out right
    padded behind its ``[CLS]`` (``families.score_prefix``), from the same ids when it shares the policy's
    vocabulary. Rows longer than ``max_length`` (or the model's positions) keep their end. A forward scores at most
    ``batch_size`` rows and, when ``max_tokens`` is set, at most that many tokens (``budget.token_chunks``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy_tokenizer: PreTrainedTokenizerBase,
        rm_tokenizer: PreTrainedTokenizerBase | None = None,
        max_length: int = 1024,
        batch_size: int = 32,
        max_tokens: int | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.policy_tokenizer = policy_tokenizer
        self.rm_tokenizer = rm_tokenizer or policy_tokenizer
        self.retokenize = not same_vocabulary(policy_tokenizer, self.rm_tokenizer)
        self.prefix = score_prefix(model, self.rm_tokenizer)
        positions = max_positions(model)
        self.max_length = max_length if positions is None else min(max_length, positions)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.packed = packs_scores(model)
        self._identity: str | None = None

    def identity(self) -> str:
        """The reward model's :func:`weights_digest` (the weights are frozen: computed once)."""
        if self._identity is None:
            self._identity = f"rm:{weights_digest(self.model)}"
        return self._identity

    @torch.no_grad()
    def __call__(self, rollout: Rollout) -> torch.Tensor:
        if not (self.retokenize or self.prefix):  # the rollout's own ids
            chunks = row_chunks(rollout.attention_mask, self.batch_size, self.max_tokens, self.packed)
            return torch.cat([self._scores(rollout.select(slice(c.start, c.stop))) for c in chunks])
        rows = self._retokenized(rollout) if self.retokenize else self._laid_out(rollout)
        rows = [keep_tail(row, self.max_length, self.prefix)[0] for row in rows]
        device, pad = rollout.query_ids.device, pad_id(self.rm_tokenizer)
        scores = []
        for c in token_chunks([len(row) for row in rows], self.batch_size, self.max_tokens, self.packed):
            ids, mask = right_pad(rows[c.start:c.stop], pad)
            scores.append(sequence_scores(self.model, ids.to(device), mask.to(device)))
        return torch.cat(scores)

    def _scores(self, chunk: Rollout) -> torch.Tensor:
        return sequence_scores(self.model, chunk.input_ids, chunk.attention_mask)

    @staticmethod
    def _laid_out(rollout: Rollout) -> list[list[int]]:
        """The real ids of each row (prompt, then response with its stop token), to go behind the prefix."""
        ids, mask = rollout.input_ids, rollout.attention_mask.bool()
        return [ids[row][mask[row]].tolist() for row in range(ids.shape[0])]

    def _retokenized(self, rollout: Rollout) -> list[list[int]]:
        """Each row's text in the reward model's tokens (eos appended where the response stopped)."""
        prompts, responses = decode_rollout(rollout, self.policy_tokenizer)
        tok = self.rm_tokenizer
        rows = []
        for prompt, response, stopped in zip(prompts, responses, rollout.stopped.tolist(), strict=True):
            ids = tok(prompt, add_special_tokens=False)["input_ids"] + tok(response, add_special_tokens=False)["input_ids"]
            if stopped and tok.eos_token_id is not None:
                ids.append(tok.eos_token_id)
            rows.append(ids)
        return rows


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

    def identity(self) -> str | None:
        """The parts' identities and weights; None when a part has no identity."""
        parts = [(scorer_identity(scorer), weight) for scorer, weight in self.parts]
        if any(identity is None for identity, _ in parts):
            return None
        return "sum(" + ", ".join(f"{weight!r}*{identity}" for identity, weight in parts) + ")"


class EnsembleScorer:
    """K reward models scoring the same rollouts, aggregated into one score (:func:`aggregate_members`).

    ``member_scores`` gives every member's scores, from which evaluation reports how far the members disagree.
    """

    def __init__(self, members: Sequence[Scorer], aggregation: EnsembleAggregation = "mean", coef: float = 1.0) -> None:
        if not members:
            raise ValueError("an ensemble needs at least one member")
        if aggregation not in ENSEMBLE_AGGREGATIONS:
            raise ValueError(f"unknown ensemble aggregation {aggregation!r}; choose one of "
                             f"{', '.join(ENSEMBLE_AGGREGATIONS)}")
        self.members, self.aggregation, self.coef = list(members), aggregation, coef

    def member_scores(self, rollout: Rollout) -> torch.Tensor:
        """Each member's scores: (K, B)."""
        return torch.stack([member(rollout).float() for member in self.members])

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        return aggregate_members(self.member_scores(rollout), self.aggregation, self.coef)

    def identity(self) -> str | None:
        """The members' identities and the aggregation; None when a member has none."""
        members = [scorer_identity(member) for member in self.members]
        if any(identity is None for identity in members):
            return None
        return f"ensemble[{self.aggregation},{self.coef!r}](" + ", ".join(members) + ")"


class EnsembleDisagreement:
    """A scorer of how far an ensemble's members disagree on each reply: the population std of their scores (B,)."""

    def __init__(self, ensemble: EnsembleScorer) -> None:
        self.ensemble = ensemble

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        return self.ensemble.member_scores(rollout).std(dim=0, unbiased=False)
