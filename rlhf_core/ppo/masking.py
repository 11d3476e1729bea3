"""Masked reductions, log-probabilities and stop-token handling.

One mask convention everywhere: ``response_mask`` is a bool tensor, True on a real response token
(the stop token included), False on padding and on anything generated after the first stop token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is True. ``x``, ``mask``: (B, T). Masked entries may hold NaN/inf."""
    kept = torch.where(mask, x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over True entries of ``mask`` (all of them, or along ``dim``).

    (B, T), (B, T) -> scalar, or (B,) with ``dim=1``. An all-False mask gives 0, not NaN.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over True entries of ``mask``. (B, T), (B, T) -> scalar.

    ``unbiased`` applies Bessel's correction n / (n - 1), as TRL and verl do.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(
                f"masked_var needs at least 2 unmasked values for an unbiased variance, got {int(n)}; "
                "use a larger rollout batch or unbiased=False"
            )
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Scale ``x`` to unit variance over the mask; with ``shift_mean`` also to zero mean.

    (B, T), (B, T) -> (B, T). Masked positions are returned as 0 so garbage there never leaks on.
    With ``shift_mean=False`` the original mean is kept (used for rewards, whose level carries meaning).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    logits: (B, T, V) already aligned so ``logits[:, t]`` predicts ``tokens[:, t]``; tokens: (B, T) -> (B, T).
    Every recomputation (rollout/old, reference, new policy) must pass the sampling temperature, or the
    PPO ratio is wrong from the first step.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the full vocabulary. (B, T, V) -> (B, T).

    Logits of -inf (banned or padded vocabulary entries) contribute 0, not ``0 * -inf = NaN``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for an entropy, got {temperature}")
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    # Zero the -inf entries before multiplying (not after) so the backward pass stays NaN-free too.
    finite_logp = torch.where(logp.isneginf(), torch.zeros_like(logp), logp)
    return -(logp.exp() * finite_logp).sum(-1)


def response_mask_from_stop(
    responses: torch.Tensor, stop_token_ids: Sequence[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask each response after its first stop token and overwrite the tail with ``pad_token_id``.

    responses: (B, T) generated ids -> (truncated responses (B, T), response_mask (B, T) bool).
    The first stop token stays unmasked (a policy that never sees its stop token rewarded never learns to
    stop); everything after it is False. Rows with no stop token keep every generated token.
    """
    if len(stop_token_ids) == 0:
        mask = torch.ones_like(responses, dtype=torch.bool)
        return responses.clone(), mask
    stops = torch.as_tensor(list(stop_token_ids), device=responses.device)
    is_stop = torch.isin(responses, stops)
    # Number of stop tokens strictly before each position: 0 means "not yet past the first stop".
    before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    mask = before == 0
    truncated = torch.where(mask, responses, torch.full_like(responses, pad_token_id))
    return truncated, mask


def ended_with_stop(
    responses: torch.Tensor, response_mask: torch.Tensor, stop_token_ids: Sequence[int]
) -> torch.Tensor:
    """True for rows whose last real token is a stop token. (B, T), (B, T) -> (B,) bool."""
    last = last_token_index(response_mask)
    last_tok = responses.gather(1, last.unsqueeze(1)).squeeze(1)
    has_any = response_mask.any(dim=1)
    stops = torch.as_tensor(list(stop_token_ids), device=responses.device)
    return has_any & torch.isin(last_tok, stops)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True entry in each row. (B, T) bool -> (B,) long; rows with none give 0."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).max(dim=1).values
