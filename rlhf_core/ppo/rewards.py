"""Per-token rewards: the KL penalty on every response token plus the sequence score on the last one; how scores
are shaped first, and how a reward-model ensemble's members make one score."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rlhf_core.ppo.masking import last_token_index


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence score on its LAST REAL response token. (B,), (B, T) -> (B, T).

    The last real token is the stop token when the response stopped, else the last generated token.
    (TRL 1.12 adds it one slot later, on the first pad when pad != eos.)
    """
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    last = last_token_index(response_mask)
    rows = torch.arange(scores.shape[0], device=scores.device)
    has_tokens = response_mask.any(dim=1)
    rewards[rows[has_tokens], last[has_tokens]] = scores[has_tokens].float()
    return rewards


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, response_mask: torch.Tensor
) -> torch.Tensor:
    """``r_t = -kl_coef * kl_t`` on every response token, plus the score on the last real one.

    ``kl_coef`` is the KL coefficient (beta in Ziegler et al.).

    scores: (B,), kl: (B, T) per-token estimate, response_mask: (B, T) -> rewards (B, T), 0 where masked.
    """
    penalty = torch.where(response_mask, -kl_coef * kl.float(), torch.zeros_like(kl, dtype=torch.float32))
    return penalty + place_scores(scores, response_mask)


def shape_scores(
    scores: torch.Tensor,
    stopped: torch.Tensor,
    missing_stop_penalty: float | None = None,
    clip: float | None = None,
    moments: RunningMoments | None = None,
) -> torch.Tensor:
    """Sequence-score shaping before placement, in this order. (B,), (B,) bool -> (B,).

    ``missing_stop_penalty`` replaces the score of responses that ran out of tokens without a stop token
    (a common trick against rambling: the score is not trusted for truncated text). ``moments`` (reward
    normalisation) are updated with the scores and normalise them (mean shifted). ``clip`` then bounds them to
    ``[-clip, clip]`` (OpenRLHF uses 10, DeepSpeed-Chat 5): normalised scores are clipped, as OpenRLHF and PPO-max do.
    """
    shaped = scores.float()
    if missing_stop_penalty is not None:
        shaped = torch.where(stopped, shaped, torch.full_like(shaped, missing_stop_penalty))
    if moments is not None:
        moments.update(shaped)
        shaped = moments.normalise(shaped)
    if clip is not None:
        shaped = shaped.clamp(-clip, clip)
    return shaped


@dataclass
class RunningMoments:
    """Running mean and std of scores across rollout batches (Chan et al. parallel update).

    Used to normalise reward-model scores to roughly unit scale without looking only at one small batch.
    """

    mean: float = 0.0
    var: float = 1.0
    count: float = 0.0

    def update(self, x: torch.Tensor) -> None:
        """Fold a batch of values (any shape) into the running statistics."""
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_var = float(x.var(unbiased=False))
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        """Running standard deviation (population)."""
        return math.sqrt(max(self.var, 0.0))

    def normalise(self, x: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
        """Scale ``x`` by the running std (and subtract the running mean when ``shift_mean``)."""
        centred = x - self.mean if shift_mean else x
        return centred / (self.std + eps)

    def state_dict(self) -> dict[str, float]:
        """JSON-serialisable state for checkpoints."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state_dict`."""
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])


EnsembleAggregation = Literal["mean", "min", "mean_minus_std"]
"""How the members of a reward-model ensemble make one score (Coste et al. 2023): their mean; the worst case
(``min``); or the mean less ``coef`` times their spread (uncertainty-weighted: replies the members disagree on
score lower, and that is where a policy exploits one member's errors)."""
ENSEMBLE_AGGREGATIONS: tuple[str, ...] = ("mean", "min", "mean_minus_std")


def aggregate_members(scores: torch.Tensor, aggregation: EnsembleAggregation = "mean",
                      coef: float = 1.0) -> torch.Tensor:
    """One score per reply from the members' scores. (K, B) -> (B,).

    ``mean_minus_std``: ``mean_k s_k - coef * std_k s_k``, the population std of the K scores (0 for one member, and
    for members that agree), so K identical members score as one (up to the rounding of their mean).
    """
    scores = scores.float()
    if aggregation == "mean":
        return scores.mean(dim=0)
    if aggregation == "min":
        return scores.min(dim=0).values
    if aggregation == "mean_minus_std":
        return scores.mean(dim=0) - coef * scores.std(dim=0, unbiased=False)
    raise ValueError(f"unknown ensemble aggregation {aggregation!r}; choose one of {', '.join(ENSEMBLE_AGGREGATIONS)}")
