"""How per-token loss terms become one number: one rule for the policy loss, value loss, entropy and KL terms.

The normaliser is fixed by the whole mini-batch (all its micro-batches, on every process), never by the piece a
forward happens to see, so that micro-batch size and process count are memory knobs only: splitting a
mini-batch into micro-batches and summing their losses gives exactly the mini-batch's loss (and gradient).

Modes (``ppo.loss_aggregation``), for per-token values ``x_it`` over a mini-batch of ``S`` sequences with ``n_i``
real tokens each (``N = sum n_i``) and at most ``L`` tokens (``ppo.generation.max_new_tokens``). The names and
meanings are verl's (``agg_loss``, 0.8), so a verl config carries over as it is:

- ``token-mean``: ``sum_it x_it / N``. Every token weighs the same (the default of verl, OpenRLHF and TRL's PPO;
  TRL GRPO's ``bnpo``). A long reply has more say than a short one: its tokens are more numerous.
- ``seq-mean-token-mean``: ``sum_i (sum_t x_it / n_i) / S``. Every sequence weighs the same (the original GRPO;
  TRL GRPO's ``grpo``). A token of a short reply weighs more than one of a long reply, which rewards short right
  answers and lets long wrong ones off lightly (the length bias Dr. GRPO points out).
- ``seq-mean-token-sum``: ``sum_it x_it / S``. Each sequence's summed loss, averaged over sequences: ``L`` times
  ``seq-mean-token-sum-norm`` when every reply is full length, so ``ppo.max_grad_norm`` and the learning rate act
  on a larger loss.
- ``seq-mean-token-sum-norm``: ``sum_it x_it / (S * L)``: a constant normaliser (Dr. GRPO; TRL GRPO's
  ``dr_grpo``). No length bias; its scale equals ``token-mean``'s when every reply is full length, smaller
  otherwise.

verl's ``-norm`` mode divides by its ``loss_scale_factor`` or else by the padded response width, which is its
``max_response_length``; ``L`` here is always ``max_new_tokens``, so the result never depends on how wide a
batch happened to be padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlhf_core.ppo.masking import masked_sum

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Normaliser:
    """What every loss term of one mini-batch is divided by (see the module docstring)."""

    mode: LossAggregation
    tokens: int
    """Real tokens in the whole mini-batch (``N``)."""
    sequences: int
    """Sequences in the whole mini-batch (``S``)."""
    max_length: int
    """``L``: the longest a reply can be (``seq-mean-token-sum-norm``)."""

    @classmethod
    def of(cls, response_mask: torch.Tensor, mode: LossAggregation = "token-mean",
           max_length: int | None = None) -> Normaliser:
        """The normaliser of a whole mini-batch, from its ``response_mask`` (S, T). ``max_length`` defaults to T."""
        if mode not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")
        return cls(mode, int(response_mask.sum()), int(response_mask.shape[0]),
                   response_mask.shape[1] if max_length is None else int(max_length))

    def per_token(self) -> Normaliser:
        """The token mean over the same mini-batch: how diagnostics (clip fractions, ratios, entropy) are reported
        whatever the loss aggregation, so they read the same across runs."""
        return Normaliser("token-mean", self.tokens, self.sequences, self.max_length)


def agg_loss(x: torch.Tensor, response_mask: torch.Tensor, normaliser: Normaliser | None = None) -> torch.Tensor:
    """This piece's share of the mini-batch's aggregate of ``x`` (B, T) -> scalar.

    ``normaliser`` describes the whole mini-batch this piece (a micro-batch, one process's share) belongs to;
    the shares of all pieces add up to the aggregate over the mini-batch. None: the piece is the whole batch,
    aggregated by token mean. Masked entries may hold NaN or inf: they never reach the result.
    """
    norm = normaliser if normaliser is not None else Normaliser.of(response_mask)
    if norm.mode == "token-mean":
        return masked_sum(x, response_mask) / max(norm.tokens, 1)
    if norm.mode == "seq-mean-token-mean":
        per_sequence = masked_sum(x, response_mask, dim=1) / response_mask.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / max(norm.sequences, 1)
    if norm.mode == "seq-mean-token-sum":
        return masked_sum(x, response_mask) / max(norm.sequences, 1)
    return masked_sum(x, response_mask) / max(norm.sequences * norm.max_length, 1)
