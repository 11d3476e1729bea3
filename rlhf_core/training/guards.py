"""Non-finite guards: a NaN or infinite loss, gradient norm, score, KL or weight stops training before the
optimizer applies the step (and before anything is checkpointed), with one line naming the quantity.

A diverged run (a learning rate of 1e3, an overflowing reward model) would otherwise go on with NaN weights that
evaluate, register and promote like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn


class NonFiniteError(FloatingPointError):
    """A training quantity is NaN or infinite; the message names it (the loops add the step)."""


def require_finite(what: str, value: float | torch.Tensor) -> float:
    """``value`` as a float, or NonFiniteError naming ``what``."""
    number = float(value)
    if not math.isfinite(number):
        raise NonFiniteError(f"{what} is {number}")
    return number


def require_finite_metrics(metrics: Mapping[str, float], keys: Iterable[str]) -> None:
    """NonFiniteError naming the first of ``keys`` whose value in ``metrics`` is not finite."""
    for key in keys:
        if key in metrics:
            require_finite(key, metrics[key])


def require_finite_weights(modules: Mapping[str, nn.Module | None]) -> None:
    """NonFiniteError naming the first parameter that holds a NaN or infinity (``{'policy': module, ...}``)."""
    for name, module in modules.items():
        if module is None:
            continue
        for parameter_name, parameter in module.named_parameters():
            if not bool(torch.isfinite(parameter.detach()).all()):
                raise NonFiniteError(f"{name} weight {parameter_name} holds NaN or infinite values")
