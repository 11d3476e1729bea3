"""One loss aggregation: hand-computed numbers for each mode, and micro-batch shares that add up to the whole."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.ppo.aggregation import AGGREGATIONS, Normaliser, agg_loss
from rlhf_core.ppo.losses import policy_loss, value_loss

X = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", (1 + 2 + 3 + 4) / 4),            # every token alike
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # every sequence alike
    ("seq-mean-token-sum", (1 + 2 + 3 + 4) / 2),     # each sequence's sum, averaged (verl)
    ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4) / (2 * 4)),  # a constant: sequences x max length (Dr. GRPO)
])
def test_each_mode_by_hand(mode: str, expected: float) -> None:
    assert float(agg_loss(X, MASK, Normaliser.of(MASK, mode))) == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_the_configured_max_length() -> None:
    assert float(agg_loss(X, MASK, Normaliser.of(MASK, "seq-mean-token-sum-norm", max_length=10))) == pytest.approx(0.5)


def test_without_a_normaliser_it_is_the_token_mean_of_the_batch_given() -> None:
    assert float(agg_loss(X, MASK)) == pytest.approx(2.5)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("micro", [1, 2, 3, 6])
def test_micro_batch_shares_add_up_to_the_mini_batch(mode: str, micro: int) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=generator)
    lengths = torch.tensor([1, 9, 3, 4, 2, 7])
    mask = torch.arange(9).expand(6, 9) < lengths[:, None]
    whole = Normaliser.of(mask, mode)
    shares = sum(agg_loss(x[i:i + micro], mask[i:i + micro], whole) for i in range(0, 6, micro))
    assert float(shares) == pytest.approx(float(agg_loss(x, mask, whole)), abs=1e-6)


def test_per_micro_batch_token_means_would_weigh_short_replies_more() -> None:
    """What the old code did (a mean per micro-batch, then averaged) differs from the mini-batch token mean."""
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True] * 4, [True, False, False, False]])
    per_micro = (agg_loss(x[:1], mask[:1]) + agg_loss(x[1:], mask[1:])) / 2
    assert float(per_micro) == pytest.approx(3.0)
    assert float(agg_loss(x, mask)) == pytest.approx(9 / 5)


def test_policy_and_value_losses_take_the_mini_batch_normaliser() -> None:
    """Shares of the clipped losses add up; diagnostics stay token means whatever the mode."""
    generator = torch.Generator().manual_seed(1)
    logp, old, adv = (torch.randn(4, 5, generator=generator) for _ in range(3))
    values, old_values, returns = (torch.randn(4, 5, generator=generator) for _ in range(3))
    mask = torch.arange(5).expand(4, 5) < torch.tensor([5, 1, 3, 2])[:, None]
    whole = Normaliser.of(mask, "seq-mean-token-sum")
    halves = [policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, whole) for i in (0, 2)]
    full = policy_loss(logp, old, adv, mask, 0.2, whole)
    assert float(sum(h.loss for h in halves)) == pytest.approx(float(full.loss), abs=1e-6)
    assert float(full.clipfrac) == pytest.approx(float(policy_loss(logp, old, adv, mask, 0.2).clipfrac))
    v_halves = [value_loss(values[i:i + 2], old_values[i:i + 2], returns[i:i + 2], mask[i:i + 2], 0.2, whole)
                for i in (0, 2)]
    v_full = value_loss(values, old_values, returns, mask, 0.2, whole)
    assert float(sum(h.loss for h in v_halves)) == pytest.approx(float(v_full.loss), abs=1e-6)


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation 'tokens'"):
        Normaliser.of(MASK, "tokens")  # type: ignore[arg-type]
