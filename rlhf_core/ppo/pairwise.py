"""Pairwise comparisons of two scores with one tie rule: a reward model's accuracy on preference pairs, and the
agreement and win rates built on it (``rlhf_core.evaluation.metrics``)."""

from __future__ import annotations

import torch


def pairwise_wins(better: torch.Tensor, worse: torch.Tensor) -> torch.Tensor:
    """THE tie rule of every pairwise accuracy and win rate here: 1 where ``better > worse``, 0.5 on a tie, 0 where
    ``better < worse``. (N,), (N,) -> (N,) float32.

    A tie is half right (the usual convention for pairwise accuracy): a model that scores everything the same is
    at 0.5, chance, not at 0 (ties wrong) or 1 (ties right).
    """
    return (better > worse).float() + 0.5 * (better == worse).float()


def pairwise_accuracy(better: torch.Tensor, worse: torch.Tensor) -> float:
    """Mean of :func:`pairwise_wins`: ``(#(better_i > worse_i) + 0.5 * #(better_i == worse_i)) / N``. (N,), (N,).

    Reward-model accuracy is ``pairwise_accuracy(s_chosen, s_rejected)``.
    """
    if better.shape != worse.shape or better.ndim != 1 or better.numel() == 0:
        raise ValueError(f"pairwise_accuracy needs two equally long, non-empty 1-D score tensors, got shapes "
                         f"{tuple(better.shape)} and {tuple(worse.shape)}")
    return float(pairwise_wins(better, worse).mean())
