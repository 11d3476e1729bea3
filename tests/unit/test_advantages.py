"""GAE, sequence-level advantages and whitening against hand numbers and a plain loop reference."""

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.ppo.advantages import gae, sequence_advantages, whiten_advantages
from rlhf_core.ppo.masking import masked_mean, masked_var

NAN, INF = float("nan"), float("inf")
GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72


def gae_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE, one row and one token at a time, reading only real (masked-in) positions.

    Masks are prefixes: a row's real tokens are 0..n-1 and the value after token n-1 is 0.
    """
    batch, length = rewards.shape
    advantages = [[0.0] * length for _ in range(batch)]
    returns = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        n = int(mask[b].sum())
        assert bool(mask[b, :n].all()), "reference loop expects prefix masks"
        last = 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            last = delta + gamma * lam * last
            advantages[b][t] = last
            returns[b][t] = last + float(values[b, t])
    return torch.tensor(advantages), torch.tensor(returns)


def random_prefix_batch(seed, batch=8, length=12):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0], lengths[1] = 0, length  # always cover an empty row and a full row
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return rewards, values, mask, gen


def test_gae_hand_1x3():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # t=2: delta = 2 + 0.9 * 0 - (-1) = 3                    A2 = 3
    # t=1: delta = 0 + 0.9 * (-1) - 1 = -1.9                 A1 = -1.9 + 0.72 * 3 = 0.26
    # t=0: delta = 1 + 0.9 * 1 - 0.5 = 1.4                   A0 = 1.4 + 0.72 * 0.26 = 1.5872
    # returns = A + V = (2.0872, 1.26, 2.0)
    advantages, returns = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
    assert_close(advantages, torch.tensor([[1.5872, 0.26, 3.0]]))
    assert_close(returns, torch.tensor([[2.0872, 1.26, 2.0]]))


def test_gae_hand_2x4_with_padding_garbage():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 999.0], [-0.1, -0.1, -0.1, 2.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 999.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    # row 0 (3 real tokens; the 999s are padding):
    #   t=2: delta = 1 + 0.9 * 0 - 0.6 = 0.4                 A2 = 0.4
    #   t=1: delta = 0 + 0.9 * 0.6 - 0.4 = 0.14              A1 = 0.14 + 0.72 * 0.4 = 0.428
    #   t=0: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16              A0 = 0.16 + 0.72 * 0.428 = 0.46816
    #   returns = (0.66816, 0.828, 1.0, 0)
    # row 1:
    #   t=3: delta = 2 + 0 - 1 = 1                           A3 = 1
    #   t=2: delta = -0.1 + 0.9 - 1 = -0.2                   A2 = -0.2 + 0.72 * 1 = 0.52
    #   t=1: delta = -0.2                                    A1 = -0.2 + 0.72 * 0.52 = 0.1744
    #   t=0: delta = -0.2                                    A0 = -0.2 + 0.72 * 0.1744 = -0.074432
    #   returns = (0.925568, 1.1744, 1.52, 2.0)
    advantages, returns = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
    assert_close(advantages, torch.tensor([[0.46816, 0.428, 0.4, 0.0], [-0.074432, 0.1744, 0.52, 1.0]]))
    assert_close(returns, torch.tensor([[0.66816, 0.828, 1.0, 0.0], [0.925568, 1.1744, 1.52, 2.0]]))


def test_gae_bootstrap_after_last_token_is_zero():
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.0, 0.5, 100.0]])
    mask = torch.tensor([[True, True, False]])
    # last real token is t=1: delta = 1 + 0.9 * 0 - 0.5 = 0.5 (the 100 must not be bootstrapped)
    # t=0: delta = 0 + 0.9 * 0.5 - 0 = 0.45; A0 = 0.45 + 0.72 * 0.5 = 0.81
    advantages, returns = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
    assert_close(advantages, torch.tensor([[0.81, 0.5, 0.0]]))
    assert_close(returns, torch.tensor([[0.81, 1.0, 0.0]]))


@pytest.mark.parametrize(("gamma", "lam"), [(0.9, 0.8), (1.0, 0.95), (1.0, 1.0), (0.5, 0.0)])
def test_gae_matches_python_loop_on_random_batches(gamma, lam):
    rewards, values, mask, _ = random_prefix_batch(seed=1)
    expected_adv, expected_ret = gae_loop(rewards, values, mask, gamma, lam)
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    assert_close(advantages, expected_adv, atol=1e-5, rtol=1e-5)
    assert_close(returns, expected_ret, atol=1e-5, rtol=1e-5)


def test_gae_ignores_garbage_at_masked_positions():
    rewards, values, mask, gen = random_prefix_batch(seed=2)
    clean_adv, clean_ret = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)

    junk = torch.randn(rewards.shape, generator=gen) * 1e6
    junk[::2, -1] = NAN
    junk[1::2, -1] = INF
    dirty_rewards = torch.where(mask, rewards, junk)
    dirty_values = torch.where(mask, values, -junk)
    dirty_adv, dirty_ret = gae(dirty_rewards, dirty_values, mask, gamma=GAMMA, lam=LAM)

    assert torch.isfinite(dirty_adv).all() and torch.isfinite(dirty_ret).all()
    assert torch.equal(dirty_adv, clean_adv)
    assert torch.equal(dirty_ret, clean_ret)


def test_gae_returns_are_advantages_plus_values_before_whitening():
    rewards, values, mask, _ = random_prefix_batch(seed=3)
    advantages, returns = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
    assert_close(returns[mask], (advantages + values)[mask])
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()

    advantages_before = advantages.clone()
    whitened = whiten_advantages(advantages, mask)
    assert torch.equal(advantages, advantages_before)  # not whitened in place
    assert not torch.allclose(whitened[mask], advantages[mask], atol=1e-3)
    # returns still match the raw advantages, and would not match the whitened ones
    assert_close(returns[mask], (advantages + values)[mask])
    assert not torch.allclose(returns[mask], (whitened + values)[mask], atol=1e-3)


def test_sequence_advantages_hand_values():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 9.0], [0.3, 0.2, NAN, INF], [NAN, 1.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 7.0, 7.0], [2.0, 7.0, 7.0, 7.0], [NAN, 7.0, 7.0, 7.0]])
    mask = torch.tensor(
        [[True, True, True, False], [True, True, False, False], [False, False, False, False]]
    )
    # row 0: R = 0.1 - 0.2 + 1.0 = 0.9; V(s) = 0.5; A = 0.4 on the 3 real tokens; returns 0.9
    # row 1: R = 0.3 + 0.2 = 0.5;       V(s) = 2.0; A = -1.5 on the 2 real tokens; returns 0.5
    # row 2: empty; garbage in rewards and in values[:, 0] must not leak NaN
    advantages, returns = sequence_advantages(rewards, values, mask)
    assert_close(
        advantages,
        torch.tensor([[0.4, 0.4, 0.4, 0.0], [-1.5, -1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )
    assert_close(
        returns,
        torch.tensor([[0.9, 0.9, 0.9, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )


def test_whiten_advantages_hand_values():
    advantages = torch.tensor([[1.0, 3.0, NAN], [5.0, INF, 123.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # kept 1, 3, 5: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> -1, 0, 1; masked -> 0
    assert_close(whiten_advantages(advantages, mask), torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_whiten_advantages_zero_mean_unit_std_over_mask():
    rewards, values, mask, _ = random_prefix_batch(seed=4)
    advantages, _ = gae(rewards * 5 + 3, values, mask, gamma=GAMMA, lam=LAM)
    whitened = whiten_advantages(advantages, mask)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert (whitened[~mask] == 0).all()
