"""Non-finite guards: a NaN or infinite loss, gradient norm or weight stops training before the optimizer applies
it, with one line naming the quantity."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rlhf_core.training.guards import NonFiniteError, require_finite, require_finite_metrics, require_finite_weights
from rlhf_core.training.strategy import TrainableGroup, local_strategy, refuse_non_finite


def _strategy(model: nn.Module):
    return local_strategy([TrainableGroup(model, list(model.parameters()), 0.1)], weight_decay=0.0, max_grad_norm=1.0)


def test_a_nan_gradient_is_never_applied():
    model = nn.Linear(3, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = _strategy(model)
    (model(torch.ones(1, 3)).sum() * math.nan).backward()
    with pytest.raises(NonFiniteError, match=r"gradient norm of parameter group 0 \(of 1\) is nan"):
        strategy.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the weights did not move
    assert all(p.grad is None for p in model.parameters())  # and the bad gradients are gone
    # a finite step afterwards works as usual
    model(torch.ones(1, 3)).sum().backward()
    (norm,) = strategy.step()
    assert math.isfinite(norm) and not torch.equal(before["weight"], model.weight)


def test_a_non_finite_loss_is_refused_before_backward_naming_its_parts():
    strategy = _strategy(nn.Linear(1, 1))
    refuse_non_finite(strategy, "PPO loss", 0.5)
    with pytest.raises(NonFiniteError, match=r"PPO loss is inf \(policy_loss 0.1, value_loss inf\)"):
        refuse_non_finite(strategy, "PPO loss", math.inf, {"policy_loss": 0.1, "value_loss": math.inf})


def test_weights_and_metrics_are_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    require_finite_weights({"policy": model, "value": None})
    with torch.no_grad():
        model[1].bias.fill_(math.nan)
    with pytest.raises(NonFiniteError, match="policy weight 1.bias holds NaN"):
        require_finite_weights({"policy": model})
    require_finite_metrics({"ppo/kl/mean": 0.1, "other": math.nan}, ["ppo/kl/mean", "absent"])
    with pytest.raises(NonFiniteError, match="ppo/kl/mean is nan"):
        require_finite_metrics({"ppo/kl/mean": math.nan}, ["ppo/kl/mean"])
    assert require_finite("x", torch.tensor(2.0)) == 2.0
