"""The rollout layout: a batch of prompts and sampled responses, and the helpers that build and read it.

Layout of every batch in the PPO loop: ``[query (left-padded, Tq) | response (right-padded, Tr)]``.
Logits at position ``t`` predict token ``t + 1``, so the response logits are ``logits[:, Tq - 1 : -1]``.
Generation (``rlhf_core.training.rollout``) makes it; the model forwards, scorers and PPO read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch


@dataclass
class Rollout:
    """A batch of sampled responses. B = batch, Tq = query length, Tr = response length."""

    query_ids: torch.Tensor
    """(B, Tq) long, left-padded prompts."""
    query_mask: torch.Tensor
    """(B, Tq) bool, True on real prompt tokens."""
    response_ids: torch.Tensor
    """(B, Tr) long, pad after the first stop token."""
    response_mask: torch.Tensor
    """(B, Tr) bool, True on real response tokens (stop token included)."""
    logprobs: torch.Tensor
    """(B, Tr) float, sampling log-probs under softmax(logits / T) (full vocab), 0 where masked."""
    stopped: torch.Tensor
    """(B,) bool, True when the response ended with a stop token."""

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, Tq + Tr) prompt and response ids."""
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, Tq + Tr) long attention mask over prompt and response."""
        return torch.cat([self.query_mask, self.response_mask], dim=1).long()

    @property
    def position_ids(self) -> torch.Tensor:
        """(B, Tq + Tr) positions counted from each row's first real token (left padding aware)."""
        return positions_from_mask(self.attention_mask)

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """Rows ``index`` of every field."""
        return Rollout(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token. (B, T) -> (B, T)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids (B, T), mask (B, T) bool)``."""
    if any(len(s) == 0 for s in sequences):
        raise ValueError("every prompt needs at least one token; got an empty prompt")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq) :] = True
    return ids, mask
