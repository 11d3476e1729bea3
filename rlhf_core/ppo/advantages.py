"""Generalised advantage estimation and its sequence-level alternative."""

from __future__ import annotations

import torch

from rlhf_core.ppo.masking import masked_whiten


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    rewards, values: (B, T) float; response_mask: (B, T) bool -> (advantages (B, T), returns (B, T)).

    Masked rewards and values are treated as 0 and the bootstrap value after the last real token is 0,
    so garbage at masked positions cannot change the result. ``returns = advantages + values`` is
    computed here, BEFORE any whitening of the advantages (whitened advantages are not returns).
    Both outputs are 0 where the mask is False. The loop runs over T (the response length), not tokens
    of every row, and is vectorised over B.
    """
    mask = response_mask.float()
    rewards = torch.where(response_mask, rewards.float(), torch.zeros_like(mask))
    values = torch.where(response_mask, values.float(), torch.zeros_like(mask))
    _, length = rewards.shape
    last_gae = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        # A masked slot carries nothing backwards: it is past the end of the sequence.
        last_gae = last_gae * mask[:, t]
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages * mask, returns * mask


def sequence_advantages(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level advantage ``A = R - V(s)`` broadcast over the response tokens.

    rewards, values: (B, T); response_mask: (B, T) -> (advantages (B, T), returns (B, T)).
    ``R`` is the undiscounted sum of the per-token rewards; ``V(s)`` is the value at the first response
    token. Every real token of a row gets the same advantage; returns are ``R`` on every real token.
    """
    mask = response_mask.float()
    total = torch.where(response_mask, rewards.float(), torch.zeros_like(mask)).sum(dim=1, keepdim=True)
    # Masked like everything else: an empty row's values[:, 0] is padding and may hold NaN.
    baseline = torch.where(response_mask[:, :1], values[:, :1].float(), torch.zeros_like(mask[:, :1]))
    advantages = (total - baseline) * mask
    returns = total.expand_as(mask) * mask
    return advantages, returns


def whiten_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Whiten advantages over the whole rollout batch, mean shifted (shift_mean=True). (B, T) -> (B, T)."""
    return masked_whiten(advantages, response_mask, shift_mean=True)
