"""Masked reductions, log-probabilities and stop-token truncation against hand-computed numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.ppo.masking import (
    ended_with_stop,
    entropy_from_logits,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_mask_from_stop,
)

NAN, INF = float("nan"), float("inf")

# Kept entries are 1, 2 (row 0) and 4 (row 1); 3, 5, 6 are masked out.
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])
# Same kept entries, garbage everywhere else.
X_GARBAGE = torch.tensor([[1.0, 2.0, NAN], [4.0, INF, -INF]])


def test_masked_sum_total_and_per_row():
    # 1 + 2 + 4 = 7; per row: 1 + 2 = 3 and 4
    assert masked_sum(X, MASK).item() == pytest.approx(7.0)
    assert_close(masked_sum(X, MASK, dim=1), torch.tensor([3.0, 4.0]))


def test_masked_mean_total_and_per_row():
    # (1 + 2 + 4) / 3 = 7/3; per row: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    assert masked_mean(X, MASK).item() == pytest.approx(7.0 / 3.0)
    assert_close(masked_mean(X, MASK, dim=1), torch.tensor([1.5, 4.0]))


def test_masked_mean_all_false_mask_is_zero_not_nan():
    # 0 / clamp(0, min=1) = 0
    empty = torch.zeros_like(MASK)
    assert masked_mean(X, empty).item() == 0.0
    assert_close(masked_mean(X, empty, dim=1), torch.tensor([0.0, 0.0]))


def test_masked_reductions_ignore_nan_and_inf_at_masked_positions():
    assert masked_sum(X_GARBAGE, MASK).item() == pytest.approx(7.0)
    assert masked_mean(X_GARBAGE, MASK).item() == pytest.approx(7.0 / 3.0)
    assert_close(masked_mean(X_GARBAGE, MASK, dim=1), torch.tensor([1.5, 4.0]))
    assert masked_var(X_GARBAGE, MASK).item() == pytest.approx(7.0 / 3.0)


def test_masked_var_biased_and_unbiased():
    # values 1, 2, 4; mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9 = 14/3
    # biased:   (14/3) / 3 = 14/9 = 1.5556 (== numpy.var([1, 2, 4]))
    # unbiased: (14/3) / 2 = 7/3  = 2.3333
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(14.0 / 9.0, rel=1e-6)
    assert masked_var(X, MASK, unbiased=True).item() == pytest.approx(7.0 / 3.0, rel=1e-6)
    assert masked_var(X, MASK).item() == pytest.approx(7.0 / 3.0, rel=1e-6)  # default is unbiased


def test_masked_var_unbiased_needs_two_values():
    one = torch.tensor([[True, False, False], [False, False, False]])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, one, unbiased=True)
    # biased variance of a single value is 0
    assert masked_var(X, one, unbiased=False).item() == 0.0


# Kept entries 2, 4 (row 0) and 6 (row 1): mean 4, deviations -2, 0, 2, unbiased var (4 + 0 + 4) / 2 = 4, std 2.
W = torch.tensor([[2.0, 4.0, 99.0], [6.0, -7.0, 123.0]])
W_GARBAGE = torch.tensor([[2.0, 4.0, NAN], [6.0, INF, -INF]])


def test_masked_whiten_shift_mean():
    # (x - 4) / 2 -> -1, 0, 1 at kept entries; masked entries are 0
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert_close(masked_whiten(W, MASK, shift_mean=True), expected)


def test_masked_whiten_keep_mean():
    # (x - 4) / 2 + 4 -> 3, 4, 5 at kept entries; masked entries are still 0
    expected = torch.tensor([[3.0, 4.0, 0.0], [5.0, 0.0, 0.0]])
    assert_close(masked_whiten(W, MASK, shift_mean=False), expected)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_ignores_garbage_at_masked_positions(shift_mean):
    clean = masked_whiten(W, MASK, shift_mean=shift_mean)
    dirty = masked_whiten(W_GARBAGE, MASK, shift_mean=shift_mean)
    assert torch.isfinite(dirty).all()
    assert_close(dirty, clean)
    assert (dirty[~MASK] == 0).all()


def test_last_token_index():
    mask = torch.tensor(
        [
            [True, True, False, False],  # last real token at 1
            [True, True, True, True],  # at 3
            [False, False, False, False],  # none -> 0
        ]
    )
    assert last_token_index(mask).tolist() == [1, 3, 0]


def test_ended_with_stop():
    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0], [5, 6, 2, 0]])
    mask = torch.tensor(
        [
            [True, True, False, False],  # last real token 2 -> stopped
            [True, True, True, True],  # last real token 8 -> stopped only if 8 is a stop id
            [False, False, False, False],  # empty row -> never "stopped"
            [True, True, False, False],  # a 2 exists but sits in a masked slot -> last real token is 6
        ]
    )
    assert ended_with_stop(responses, mask, [2]).tolist() == [True, False, False, False]
    assert ended_with_stop(responses, mask, [2, 8]).tolist() == [True, True, False, False]
    assert ended_with_stop(responses, mask, []).tolist() == [False, False, False, False]


# One row, two positions, vocab of 3 with logits (0, 1, 2) at both; tokens 2 then 0.
LOGITS = torch.tensor([[[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]])
TOKENS = torch.tensor([[2, 0]])


def test_logprobs_from_logits_temperature_one():
    # logsumexp(0, 1, 2) = log(1 + e + e^2) = log(11.107338) = 2.407606
    # log p(2) = 2 - 2.407606 = -0.407606; log p(0) = 0 - 2.407606 = -2.407606
    lse = math.log(1 + math.e + math.e**2)
    assert lse == pytest.approx(2.407606, abs=1e-6)
    expected = torch.tensor([[2.0 - lse, 0.0 - lse]])
    assert_close(logprobs_from_logits(LOGITS, TOKENS), expected)
    assert_close(expected, torch.tensor([[-0.407606, -2.407606]]), atol=1e-6, rtol=0)


def test_logprobs_from_logits_temperature_half_and_two():
    # T = 0.5: logits / T = (0, 2, 4); lse = log(1 + e^2 + e^4) = log(62.987206) = 4.142932
    #   log p(2) = 4 - 4.142932 = -0.142932; log p(0) = -4.142932
    assert_close(
        logprobs_from_logits(LOGITS, TOKENS, temperature=0.5),
        torch.tensor([[-0.142932, -4.142932]]),
        atol=1e-5,
        rtol=0,
    )
    # T = 2: logits / T = (0, 0.5, 1); lse = log(1 + e^0.5 + e) = log(5.367003) = 1.680270
    #   log p(2) = 1 - 1.680270 = -0.680270; log p(0) = -1.680270
    assert_close(
        logprobs_from_logits(LOGITS, TOKENS, temperature=2.0),
        torch.tensor([[-0.680270, -1.680270]]),
        atol=1e-5,
        rtol=0,
    )


def test_logprobs_temperature_matters():
    at_one = logprobs_from_logits(LOGITS, TOKENS, temperature=1.0)
    at_half = logprobs_from_logits(LOGITS, TOKENS, temperature=0.5)
    assert (at_one - at_half).abs().min() > 0.2


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_logprobs_reject_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(LOGITS, TOKENS, temperature=temperature)


def test_entropy_uniform_is_log_vocab():
    # p = 1/4 each: H = -4 * (1/4) * log(1/4) = log 4 = 1.386294
    logits = torch.zeros(2, 3, 4)
    assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(4.0)))


def test_entropy_near_one_hot_is_zero():
    # p(others) = e^-100 / (1 + 2e^-100) ~ 4e-44: H ~ 2 * 100 * 4e-44, i.e. 0 in float32
    logits = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_with_temperature():
    # logits (0, ln 3): p = (1/4, 3/4)
    #   H = 0.25 * ln 4 + 0.75 * ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # T = 0.5: logits (0, 2 ln 3) = (0, ln 9): p = (1/10, 9/10)
    #   H = 0.1 * ln 10 + 0.9 * ln(10/9) = 0.230259 + 0.094824 = 0.325083
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert entropy_from_logits(logits).item() == pytest.approx(0.562335, abs=1e-5)
    assert entropy_from_logits(logits, temperature=0.5).item() == pytest.approx(0.325083, abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=0.0)


def test_entropy_banned_tokens_contribute_zero_and_no_nan_gradient():
    # (0, 0, -inf): p = (1/2, 1/2, 0): H = log 2 = 0.693147; the -inf entry must not give 0 * -inf = NaN
    logits = torch.tensor([[[0.0, 0.0, -INF]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy.item() == pytest.approx(math.log(2.0), abs=1e-6)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_response_mask_truncates_after_first_stop():
    responses = torch.tensor(
        [
            [5, 2, 7, 2],  # first stop at 1: keep 5, 2; second 2 is after the stop -> padded
            [5, 6, 7, 8],  # no stop: keep everything
            [2, 9, 9, 9],  # stop first: keep only the stop token
        ]
    )
    original = responses.clone()
    truncated, mask = response_mask_from_stop(responses, stop_token_ids=[2], pad_token_id=0)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, False, False, False],
    ]
    assert truncated.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]]
    assert torch.equal(responses, original)  # input is not modified in place


def test_response_mask_several_stop_ids():
    responses = torch.tensor([[5, 8, 2, 7], [5, 6, 2, 8]])
    truncated, mask = response_mask_from_stop(responses, stop_token_ids=[2, 8], pad_token_id=0)
    # row 0 stops at the 8 (index 1); row 1 at the 2 (index 2), the later 8 is cut
    assert mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert truncated.tolist() == [[5, 8, 0, 0], [5, 6, 2, 0]]


def test_response_mask_empty_stop_list_keeps_everything():
    responses = torch.tensor([[5, 2, 7], [1, 1, 1]])
    truncated, mask = response_mask_from_stop(responses, stop_token_ids=[], pad_token_id=0)
    assert mask.all()
    assert torch.equal(truncated, responses)
    truncated[0, 0] = 99
    assert responses[0, 0] == 5  # a copy, not a view
