"""Per-token reward placement, score shaping and running moments against hand-computed numbers."""

import json
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from rlhf_core.ppo.masking import response_mask_from_stop
from rlhf_core.ppo.rewards import RunningMoments, place_scores, shape_scores, token_rewards

NAN, INF = float("nan"), float("inf")
STOP, PAD = 2, 0

# Row 0 stops at index 2 (then junk), row 1 never stops, row 2 is empty (the mask is all False).
RESPONSES = torch.tensor([[5, 6, STOP, 9, 9], [5, 6, 7, 8, 9], [PAD] * 5])
MASK = torch.tensor(
    [
        [True, True, True, False, False],
        [True, True, True, True, True],
        [False, False, False, False, False],
    ]
)
SCORES = torch.tensor([1.5, -2.0, 3.0])


def test_mask_fixture_matches_stop_truncation():
    _, mask = response_mask_from_stop(RESPONSES[:2], [STOP], PAD)
    assert torch.equal(mask, MASK[:2])


def test_place_scores_on_last_real_token_not_first_pad():
    rewards = place_scores(SCORES, MASK)
    expected = torch.tensor(
        [
            [0.0, 0.0, 1.5, 0.0, 0.0],  # on the stop token (index 2), not on the first pad (index 3)
            [0.0, 0.0, 0.0, 0.0, -2.0],  # no stop: on the last generated token
            [0.0, 0.0, 0.0, 0.0, 0.0],  # empty response: nowhere to put it
        ]
    )
    assert_close(rewards, expected)
    assert rewards[0, 3] == 0.0
    assert rewards.dtype == torch.float32


def test_token_rewards_kl_penalty_plus_score():
    kl_coef = 0.1
    kl = torch.tensor(
        [
            [0.5, -1.0, 2.0, NAN, INF],  # garbage after the stop
            [1.0, 1.0, 1.0, 1.0, 1.0],
            [NAN, INF, -INF, 7.0, 7.0],  # empty row: all garbage
        ]
    )
    expected = torch.tensor(
        [
            # -0.1 * 0.5 = -0.05; -0.1 * -1 = +0.1; -0.1 * 2 + 1.5 = 1.3; masked -> 0
            [-0.05, 0.1, 1.3, 0.0, 0.0],
            # -0.1 on every token; the last also gets -2.0 -> -2.1
            [-0.1, -0.1, -0.1, -0.1, -2.1],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    rewards = token_rewards(SCORES, kl, kl_coef, MASK)
    assert torch.isfinite(rewards).all()
    assert_close(rewards, expected)


def test_token_rewards_zero_kl_coef_is_just_the_scores():
    kl = torch.ones(3, 5)
    assert_close(token_rewards(SCORES, kl, 0.0, MASK), place_scores(SCORES, MASK))


def test_shape_scores_missing_stop_penalty_only_on_non_stopped_rows():
    scores = torch.tensor([1.0, 20.0, -30.0, 4.0])
    stopped = torch.tensor([True, True, False, False])
    # rows 2 and 3 did not stop: their scores become -1; stopped rows keep theirs
    assert_close(shape_scores(scores, stopped, missing_stop_penalty=-1.0), torch.tensor([1.0, 20.0, -1.0, -1.0]))


def test_shape_scores_clip():
    scores = torch.tensor([1.0, 20.0, -30.0, 4.0])
    stopped = torch.tensor([True, True, False, False])
    # clamp to [-10, 10]
    assert_close(shape_scores(scores, stopped, clip=10.0), torch.tensor([1.0, 10.0, -10.0, 4.0]))
    # penalty first, then clip: -15 -> -10 for the non-stopped rows; 20 -> 10
    assert_close(
        shape_scores(scores, stopped, missing_stop_penalty=-15.0, clip=10.0),
        torch.tensor([1.0, 10.0, -10.0, -10.0]),
    )
    # neither: unchanged
    assert_close(shape_scores(scores, stopped), scores)


def test_running_moments_match_numpy_on_concatenation():
    batches = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0, 5.0], [6.0, 7.0]]), torch.tensor([10.0])]
    moments = RunningMoments()
    for batch in batches:
        moments.update(batch)
    # 1..7 and 10: sum 38, n 8, mean 4.75; sum of squares 140 + 100 = 240;
    # var = 240 / 8 - 4.75^2 = 30 - 22.5625 = 7.4375; std = 2.727178
    assert moments.count == 8
    assert moments.mean == pytest.approx(4.75, abs=1e-12)
    assert moments.var == pytest.approx(7.4375, abs=1e-12)
    assert moments.std == pytest.approx(math.sqrt(7.4375), abs=1e-12)
    flat = np.concatenate([b.numpy().ravel() for b in batches]).astype(np.float64)
    assert moments.mean == pytest.approx(flat.mean(), abs=1e-12)
    assert moments.var == pytest.approx(flat.var(), abs=1e-12)


def test_running_moments_random_batches_match_numpy():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=gen) * 3 + 2 for n in (1, 7, 32, 5)]
    moments = RunningMoments()
    for batch in batches:
        moments.update(batch)
    flat = torch.cat(batches).double().numpy()
    assert moments.mean == pytest.approx(flat.mean(), rel=1e-9)
    assert moments.var == pytest.approx(flat.var(), rel=1e-9)


def test_running_moments_empty_batch_is_a_no_op():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 3.0]))
    before = moments.state_dict()
    moments.update(torch.tensor([]))
    assert moments.state_dict() == before


def test_running_moments_normalise():
    moments = RunningMoments()
    moments.update(torch.tensor([2.0, 4.0, 6.0, 8.0]))
    # mean 5, population var (9 + 1 + 1 + 9) / 4 = 5, std sqrt 5 = 2.236068
    x = torch.tensor([5.0, 7.236068])
    assert_close(moments.normalise(x), torch.tensor([0.0, 1.0]), atol=1e-6, rtol=0)
    # without the shift: 5 / sqrt 5 = 2.236068
    assert_close(moments.normalise(x, shift_mean=False)[0], torch.tensor(2.236068), atol=1e-6, rtol=0)


def test_running_moments_state_dict_round_trip():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0]))
    restored = RunningMoments()
    restored.load_state_dict(json.loads(json.dumps(moments.state_dict())))
    assert restored == moments
    moments.update(torch.tensor([10.0, -4.0]))
    restored.update(torch.tensor([10.0, -4.0]))
    assert restored.state_dict() == moments.state_dict()
