"""Non-finite guards: a NaN or infinite loss, gradient norm, score, KL or weight stops training before the
optimizer applies the step (and before anything is checkpointed), with one line naming the quantity.

A diverged run (a learning rate of 1e3, an overflowing reward model) would otherwise go on with NaN weights that
evaluate, register and promote like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rlhf_core.training.strategy import Strategy


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


def refuse_non_finite(strategy: Strategy, what: str, value: float, parts: dict[str, float] | None = None) -> None:
    """NonFiniteError when ``value`` is NaN or infinite on any rank (all ranks agree, so none waits in a
    collective for one that stopped), before its backward: nothing of the step is applied."""
    bad = float(not math.isfinite(value))
    if strategy.world_size > 1:
        bad = strategy.all_sum({"non_finite": bad})["non_finite"]
    if bad and math.isfinite(value):
        raise NonFiniteError(f"{what} is not finite on another process")
    if bad:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in (parts or {}).items())
        raise NonFiniteError(f"{what} is {value}" + (f" ({shown})" if shown else ""))
