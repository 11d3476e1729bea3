"""Advantage estimators: with a value model (GAE, sequence-level) and critic-free (GRPO, RLOO, REINFORCE++).

The critic-free ones work in two steps: :func:`baseline_scores` turns each reply's sequence score into a
baseline-adjusted score (against its group of ``samples_per_prompt`` replies to the same prompt, or none), then
that score goes on the last real token next to the per-token KL penalties and :func:`returns_to_go` sums the
rewards from each token on: the advantage of a token (no value model, so returns = advantages).
"""

from __future__ import annotations

import torch

from rlhf_core.ppo.masking import masked_whiten

CRITIC_FREE = ("grpo", "rloo", "reinforce_pp")


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


def baseline_scores(scores: torch.Tensor, estimator: str, group_size: int, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Sequence scores adjusted by a critic-free estimator's baseline. (B,) -> (B,).

    Rows ``g * group_size .. (g + 1) * group_size - 1`` are the replies to one prompt (``samples_per_prompt``).

    - ``grpo``: ``(s - mean_g) / (std_g + eps)``, ``std_g`` with Bessel's correction (as TRL and OpenRLHF);
      ``scale_by_std=False`` keeps ``s - mean_g`` (Dr. GRPO: the division up-weights prompts whose replies
      score alike, too easy or too hard);
    - ``rloo``: ``s - mean of the other replies to the prompt`` = ``k / (k - 1) * (s - mean_g)``;
    - ``reinforce_pp``: ``s`` (REINFORCE++ has no per-prompt baseline; it whitens over the batch instead).
    """
    if estimator not in CRITIC_FREE:
        raise ValueError(f"unknown critic-free estimator {estimator!r}; choose one of {', '.join(CRITIC_FREE)}")
    scores = scores.float()
    if estimator == "reinforce_pp":
        return scores
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"{estimator} needs whole groups of >= 2 replies per prompt; got {scores.shape[0]} scores "
                         f"in groups of {group_size}")
    groups = scores.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        return ((groups - mean) * group_size / (group_size - 1)).flatten()
    centred = groups - mean
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


def returns_to_go(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = sum_{t' >= t} gamma^(t' - t) r_t'`` over each row's real tokens. (B, T), (B, T) -> (B, T).

    Masked rewards count as 0 and masked positions are 0 in the result (garbage there never leaks in).
    """
    mask = response_mask.float()
    rewards = torch.where(response_mask, rewards.float(), torch.zeros_like(mask))
    running = torch.zeros_like(rewards[:, 0])
    reversed_returns = []
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        reversed_returns.append(running)
    return torch.stack(reversed_returns[::-1], dim=1)
