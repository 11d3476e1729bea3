"""PPO policy/value losses, the Bradley-Terry loss and the combined objective against hand numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.ppo.losses import bradley_terry_loss, policy_loss, ppo_objective, value_loss

NAN, INF = float("nan"), float("inf")
CLIP = 0.2

# Five real tokens (row 1, slot 2 is padding), clip range 0.2 -> [0.8, 1.2]:
#   tok  ratio  A    -A*r   -A*clip(r)  max    clipped branch taken?
#   0    1.5   +1   -1.5    -1.2        -1.2   yes (-1.2 > -1.5)
#   1    0.5   +1   -0.5    -0.8        -0.5   no
#   2    1.5   -1   +1.5    +1.2        +1.5   no
#   3    0.5   -1   +0.5    +0.8        +0.8   yes (0.8 > 0.5)
#   4    1.1   +2   -2.2    -2.2        -2.2   no (inside the range: equal)
RATIOS = torch.tensor([[1.5, 0.5, 1.5], [0.5, 1.1, 1.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD_LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])


def new_logprobs(old=OLD_LOGPROBS, ratios=RATIOS):
    return (old + ratios.log()).requires_grad_(True)


def test_policy_loss_hand_values():
    out = policy_loss(new_logprobs(), OLD_LOGPROBS, ADVANTAGES, MASK, clip_range=CLIP)
    # loss = (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5 = -1.6 / 5 = -0.32
    assert out.loss.item() == pytest.approx(-0.32, abs=1e-6)
    # clipped branch on tokens 0 and 3: 2 / 5
    assert out.clipfrac.item() == pytest.approx(0.4, abs=1e-6)
    # log-ratios ln1.5 = 0.405465, ln0.5 = -0.693147, ln1.1 = 0.095310; squares:
    # 0.164402 + 0.480453 + 0.164402 + 0.480453 + 0.009084 = 1.298794; mean 0.259759; half 0.129879
    assert out.approx_kl.item() == pytest.approx(0.129879, abs=1e-5)
    assert out.approx_kl.item() == pytest.approx(
        0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2 + math.log(1.1) ** 2) / 5, abs=1e-6
    )
    # (1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5 = 1.02
    assert out.ratio_mean.item() == pytest.approx(1.02, abs=1e-6)


def test_policy_loss_gradient_hand_values_and_zero_at_masked_positions():
    logprobs = new_logprobs()
    policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, clip_range=CLIP).loss.backward()
    # d(-A * r)/d logp = -A * r, divided by 5 tokens; a taken clipped branch has zero gradient:
    #   tok 0: clipped -> 0;  tok 1: -1 * 0.5 / 5 = -0.1;  tok 2: +1 * 1.5 / 5 = 0.3
    #   tok 3: clipped -> 0;  tok 4: -2 * 1.1 / 5 = -0.44;  masked slot -> 0
    expected = torch.tensor([[0.0, -0.1, 0.3], [0.0, -0.44, 0.0]])
    assert_close(logprobs.grad, expected, atol=1e-6, rtol=1e-5)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    advantages = torch.tensor([[1.0, -2.0, 3.0], [0.5, 4.0, 100.0]])
    logprobs = OLD_LOGPROBS.clone().requires_grad_(True)
    out = policy_loss(logprobs, OLD_LOGPROBS, advantages, MASK, clip_range=CLIP)
    # -(1 - 2 + 3 + 0.5 + 4) / 5 = -6.5 / 5 = -1.3 (the 100 is masked)
    assert out.loss.item() == pytest.approx(-1.3, abs=1e-6)
    assert out.clipfrac.item() == 0.0
    assert out.approx_kl.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)


def test_policy_loss_ignores_garbage_at_masked_positions():
    clean_logprobs = new_logprobs()
    clean = policy_loss(clean_logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, clip_range=CLIP)
    clean.loss.backward()

    garbage = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, NAN]])
    dirty_logprobs = (new_logprobs().detach() + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, INF]]))
    dirty_logprobs.requires_grad_(True)
    dirty = policy_loss(
        dirty_logprobs, OLD_LOGPROBS + garbage, ADVANTAGES + garbage, MASK, clip_range=CLIP
    )
    dirty.loss.backward()

    for field in ("loss", "clipfrac", "approx_kl", "ratio_mean"):
        assert_close(getattr(dirty, field), getattr(clean, field))
    assert torch.isfinite(dirty_logprobs.grad).all()
    assert_close(dirty_logprobs.grad, clean_logprobs.grad)


# Three real tokens and one padded slot, value clip 0.2:
#   tok  V    V_old  R    (V-R)^2  V_clip = V_old + clip(V-V_old)  (V_clip-R)^2  max   clipped wins?
#   0    1.0  0.0    1.0  0.0      0.2                              0.64          0.64  yes
#   1    1.0  0.0    0.0  1.0      0.2                              0.04          1.0   no
#   2    0.1  0.0    1.0  0.81     0.1 (inside the range)           0.81          0.81  no (equal)
VALUES = torch.tensor([[1.0, 1.0, 0.1, 5.0]])
OLD_VALUES = torch.tensor([[0.0, 0.0, 0.0, NAN]])
RETURNS = torch.tensor([[1.0, 0.0, 1.0, INF]])
VMASK = torch.tensor([[True, True, True, False]])


def test_value_loss_clipped_hand_values():
    values = VALUES.clone().requires_grad_(True)
    out = value_loss(values, OLD_VALUES, RETURNS, VMASK, clip_range_value=0.2)
    # 0.5 * (0.64 + 1.0 + 0.81) / 3 = 0.5 * 2.45 / 3 = 0.408333
    assert out.loss.item() == pytest.approx(0.408333, abs=1e-5)
    assert out.clipfrac.item() == pytest.approx(1.0 / 3.0, abs=1e-6)
    out.loss.backward()
    # tok 0: clipped branch wins and V is outside the clip range -> 0
    # tok 1: 0.5 * 2 * (1 - 0) / 3 = 0.333333;  tok 2: 0.5 * 2 * (0.1 - 1) / 3 = -0.3
    # padded slot (NaN old value, inf return): exactly 0, not NaN
    assert_close(values.grad, torch.tensor([[0.0, 1.0 / 3.0, -0.3, 0.0]]), atol=1e-6, rtol=1e-5)


def test_value_loss_clipped_branch_wins_alone():
    # only token 0: loss = 0.5 * 0.64 = 0.32, clipfrac 1
    mask = torch.tensor([[True, False, False, False]])
    out = value_loss(VALUES, OLD_VALUES, RETURNS, mask, clip_range_value=0.2)
    assert out.loss.item() == pytest.approx(0.32, abs=1e-6)
    assert out.clipfrac.item() == 1.0


def test_value_clipfrac_counts_only_where_the_clamp_binds():
    """Inside the clip range V_old + (V - V_old) is V up to rounding: the rounding must not count as clipping."""
    # tokens 0 and 1: |V - V_old| < 0.2, yet in float32 the "clipped" term comes out above the unclipped one
    old = torch.tensor([[0.2168232500553131, -0.1893986016511917, 0.0, 0.0]])
    values = torch.tensor([[0.04796845465898514, -0.002194436267018318, 0.1, 0.5]])  # token 3 moves past eps
    returns = torch.tensor([[1.7656660079956055, -0.5454821586608887, 1.0, -3.0]])
    mask = torch.ones_like(values, dtype=torch.bool)
    clipped = old + torch.clamp(values - old, -0.2, 0.2)
    assert ((clipped - returns) ** 2 > (values - returns) ** 2)[0, :2].all()  # what a plain comparison counts
    # token 3: clipped (0.2 + 3)^2 = 10.24 < (0.5 + 3)^2 = 12.25, the unclipped term is taken: nothing clipped
    assert value_loss(values, old, returns, mask, clip_range_value=0.2).clipfrac.item() == 0.0
    # returns of token 3 at +3: clipped (0.2 - 3)^2 = 7.84 > (0.5 - 3)^2 = 6.25: 1 token of 4
    returns[0, 3] = 3.0
    assert value_loss(values, old, returns, mask, clip_range_value=0.2).clipfrac.item() == pytest.approx(0.25)


def test_value_loss_without_clipping():
    values = VALUES.clone().requires_grad_(True)
    out = value_loss(values, OLD_VALUES, RETURNS, VMASK, clip_range_value=None)
    # 0.5 * (0 + 1 + 0.81) / 3 = 0.5 * 1.81 / 3 = 0.301667
    assert out.loss.item() == pytest.approx(0.301667, abs=1e-5)
    assert out.clipfrac.item() == 0.0
    out.loss.backward()
    # (V - R) / 3: 0, 1/3, -0.3; padded slot 0
    assert_close(values.grad, torch.tensor([[0.0, 1.0 / 3.0, -0.3, 0.0]]), atol=1e-6, rtol=1e-5)


def test_bradley_terry_hand_values():
    chosen = torch.tensor([2.0, 0.0])
    rejected = torch.tensor([1.0, 1.0])
    # d = (1, -1): -log sigmoid(1) = log(1 + e^-1) = 0.313262; -log sigmoid(-1) = log(1 + e) = 1.313262
    # mean = 0.813262
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(0.813262, abs=1e-5)


def test_bradley_terry_with_margin():
    chosen = torch.tensor([2.0, 0.0])
    rejected = torch.tensor([1.0, 1.0])
    margin = torch.tensor([0.5, 0.5])
    # d = (0.5, -1.5): log(1 + e^-0.5) = 0.474077; log(1 + e^1.5) = 1.701413; mean = 1.087745
    assert bradley_terry_loss(chosen, rejected, margin).item() == pytest.approx(1.087745, abs=1e-5)


def test_bradley_terry_gradient_pushes_chosen_up():
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    # d/dchosen of -log sigmoid(c - r) at 0 = -(1 - sigmoid(0)) = -0.5; rejected gets +0.5
    assert chosen.grad.item() == pytest.approx(-0.5)
    assert rejected.grad.item() == pytest.approx(0.5)


def test_ppo_objective_without_kl_term():
    # 1.0 + 0.1 * 2.0 - 0.01 * 0.5 = 1.0 + 0.2 - 0.005 = 1.195
    total = ppo_objective(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5), vf_coef=0.1, entropy_coef=0.01)
    assert total.item() == pytest.approx(1.195, abs=1e-6)


def test_ppo_objective_with_kl_term():
    args = (torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5))
    # 1.195 + 0.05 * 3.0 = 1.345
    total = ppo_objective(*args, vf_coef=0.1, entropy_coef=0.01, kl_loss=torch.tensor(3.0), kl_coef=0.05)
    assert total.item() == pytest.approx(1.345, abs=1e-6)
    # a KL loss with the default coefficient 0 changes nothing
    unweighted = ppo_objective(*args, vf_coef=0.1, entropy_coef=0.01, kl_loss=torch.tensor(3.0))
    assert unweighted.item() == pytest.approx(1.195, abs=1e-6)
