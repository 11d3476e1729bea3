"""KL estimators and KL-coefficient controllers against hand-computed numbers."""

import json
import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.ppo.kl import AdaptiveKLController, FixedKLController, kl_estimate

# log_ratio = logp - logp_ref = (0.5, -1.0, 0.0)
LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])


def test_k1_is_logp_minus_ref():
    assert_close(kl_estimate(LOGP, REF, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))


def test_k2_is_half_squared_log_ratio():
    # 0.5 * 0.5^2 = 0.125; 0.5 * (-1)^2 = 0.5; 0
    assert_close(kl_estimate(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5, 0.0]]))


def test_k3_hand_values():
    # with u = ref - logp = (-0.5, 1.0, 0.0): k3 = e^u - 1 - u
    #   e^-0.5 - 1 + 0.5 = 0.606531 - 0.5 = 0.106531
    #   e^1 - 1 - 1       = 2.718282 - 2   = 0.718282
    #   e^0 - 1 - 0       = 0
    expected = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    assert_close(kl_estimate(LOGP, REF, "k3"), expected)
    assert_close(expected, torch.tensor([[0.106531, 0.718282, 0.0]]), atol=1e-6, rtol=0)


def test_abs_estimator():
    assert_close(kl_estimate(LOGP, REF, "abs"), torch.tensor([[0.5, 1.0, 0.0]]))


def test_default_estimator_is_k1():
    assert_close(kl_estimate(LOGP, REF), kl_estimate(LOGP, REF, "k1"))


def test_k1_direction_policy_minus_reference():
    # The policy puts more mass on its own sample than the reference does -> positive k1.
    policy = torch.tensor([[-0.1]])
    reference = torch.tensor([[-2.0]])
    assert kl_estimate(policy, reference, "k1").item() == pytest.approx(1.9)
    assert kl_estimate(reference, policy, "k1").item() == pytest.approx(-1.9)


def test_k3_non_negative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(8, 16, generator=gen) * 3
    ref = torch.randn(8, 16, generator=gen) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    for estimator in ("k1", "k2", "k3", "abs"):
        assert (kl_estimate(logp, logp, estimator) == 0).all()


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(LOGP, REF, "k4")  # type: ignore[arg-type]


def test_fixed_controller_ignores_kl_and_round_trips():
    ctl = FixedKLController(coef=0.1)
    ctl.update(current_kl=100.0, n_steps=64)
    assert ctl.coef == 0.1
    state = json.loads(json.dumps(ctl.state_dict()))
    other = FixedKLController(coef=0.5)
    other.load_state_dict(state)
    assert other.coef == 0.1


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        # error = 6.6 / 6 - 1 = 0.1 (inside the clip): 0.1 * (1 + 0.1 * 256 / 10000) = 0.1 * 1.00256
        (6.6, 0.100256),
        # error = 12 / 6 - 1 = 1 -> clipped to +0.2: 0.1 * (1 + 0.2 * 0.0256) = 0.1 * 1.00512
        (12.0, 0.100512),
        # error = 0 / 6 - 1 = -1 -> clipped to -0.2: 0.1 * (1 - 0.2 * 0.0256) = 0.1 * 0.99488
        (0.0, 0.099488),
        # error = 3 / 6 - 1 = -0.5 -> clipped to -0.2 as well
        (3.0, 0.099488),
        # on target: error 0, unchanged
        (6.0, 0.1),
    ],
)
def test_adaptive_controller_update(current_kl, expected):
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=10000.0)
    ctl.update(current_kl=current_kl, n_steps=256)
    assert ctl.coef == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_compounds_and_round_trips():
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=10000.0)
    ctl.update(12.0, 256)  # 0.1 * 1.00512 = 0.100512
    ctl.update(12.0, 256)  # 0.100512 * 1.00512 = 0.101026621...
    assert ctl.coef == pytest.approx(0.1 * 1.00512**2, rel=1e-12)

    state = json.loads(json.dumps(ctl.state_dict()))
    restored = AdaptiveKLController(coef=1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(state)
    assert (restored.coef, restored.target, restored.horizon) == (ctl.coef, 6.0, 10000.0)
    ctl.update(0.0, 100)
    restored.update(0.0, 100)
    assert restored.coef == ctl.coef
