"""How the training loops turn losses into weight updates: in this process, or data-parallel over several.

Every training loop (SFT, reward model, PPO, DPO) calls only the :class:`Strategy` interface (backward, step,
zero_grad, and a few data-parallel questions), so each algorithm is written once and the optimizer, the clipping
and the learning-rate schedule (:func:`scheduled_learning_rate`) once for all of them. SFT and DPO run in one
process (:func:`scheduled_strategy`); the reward model and PPO also on DeepSpeed workers. :class:`LocalStrategy` is
one process with a torch AdamW; ``rlhf_core.distributed.zero`` builds the DeepSpeed ZeRO one (the only module
that imports deepspeed) from the same :class:`TrainableGroup` list through a :class:`StrategyFactory`.

Data-parallel contract, what makes N processes compute what one process computes:
- every rank holds the same global batch in the same order (same seeds, same shuffles);
- each rank takes a contiguous share of each batch (:func:`shard`, :func:`weighted_shard`) and scales its
  loss as if its share were the whole batch; the strategy averages gradients over ranks, so the update is the
  one-process update up to float summation order;
- statistics are summed over ranks (:meth:`Strategy.all_sum`) before anyone reads them.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from rlhf_core.config import OptimizerConfig
from rlhf_core.training.checkpoint import load_checkpoint, save_checkpoint
from rlhf_core.training.guards import NonFiniteError

T = TypeVar("T")
LRLambda = Callable[[int], float]


@dataclass(frozen=True)
class TrainableGroup:
    """One trained model: what its training forward calls, the parameters it trains, its learning rate."""

    module: nn.Module
    """The module the training forward goes through (DeepSpeed wraps exactly this one in an engine)."""
    params: list[nn.Parameter]
    """Its trained parameters (all of them, or a LoRA adapter and heads)."""
    learning_rate: float
    """Peak learning rate (before the schedule)."""


class Strategy(Protocol):
    """What a training loop needs from the machinery that applies its gradients."""

    rank: int
    """This process's index among ``world_size`` data-parallel processes (0 in one process)."""
    world_size: int
    """Number of data-parallel processes."""
    modules: tuple[nn.Module, ...]
    """What training forwards call, one per :class:`TrainableGroup` in order (DeepSpeed: the engines)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss`` (already scaled to this rank's share of the batch)."""

    def step(self, frozen: Sequence[int] = ()) -> tuple[float, ...]:
        """Clip each model's gradients to its max norm, step the optimizer(s) and the LR schedule.

        Groups whose index is in ``frozen`` are not stepped: their gradients are dropped and their optimizer state
        (moments, step count) stays as it was (critic warm-up holds the policy still). Returns each model's gradient
        norm before clipping, in group order (0 for a frozen group).
        """

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    def learning_rate(self) -> float:
        """Current learning rate of the first group."""

    def all_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over ranks (identity in one process)."""

    def all_gather(self, obj: T) -> list[T]:
        """``obj`` from every rank, in rank order (``[obj]`` in one process)."""

    def inference(self, module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """A block with a module computing what ``module`` computes, whose forwards need no other rank.

        ZeRO-3 keeps a shard of each weight per rank and gathers layer by layer in every forward, which is
        collective, but rollouts run a different number of forwards per rank (generation lengths differ):
        they use this module, a full copy of the current weights that lives only for the block.
        """

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s complete weights with its own key names (not an engine's ``module.`` ones)."""

    def sampling_generator(self, generator: torch.Generator) -> torch.Generator:
        """The generator this rank samples rollouts with; ``generator`` stays identical on every rank."""

    def save_checkpoint(self, root: str | os.PathLike[str], step: int, modules: dict[str, nn.Module],
                        generator: torch.Generator, state: dict[str, Any], keep: int = 2) -> Path:
        """Write ``<root>/step_<step>`` (weights, optimizer, schedule, RNGs, ``state``) atomically; keep the newest
        ``keep`` checkpoints under ``root``."""

    def load_checkpoint(self, path: str | os.PathLike[str], modules: dict[str, nn.Module],
                        generator: torch.Generator) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote, in place; return the JSON state."""


def scheduled_learning_rate(peak: float, step: int, warmup_steps: int, lr_schedule: str, total_steps: int) -> float:
    """Learning rate at 0-based optimizer ``step``: linear warmup to ``peak``, then constant ('constant') or a
    linear decay towards 0 at the last step ('linear'). The one schedule of every training loop (SFT, DPO, PPO);
    ``peak=1.0`` gives the multiplier a ``LambdaLR`` takes."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if lr_schedule == "constant":
        return peak
    return peak * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def scheduled_strategy(model: nn.Module, settings: OptimizerConfig, total_steps: int) -> LocalStrategy:
    """The one-process strategy of a loop that trains one model (SFT, DPO): AdamW on its trained parameters
    (:func:`local_strategy`), gradients clipped to ``settings.max_grad_norm``, and the learning rate of
    :func:`scheduled_learning_rate` at each of ``total_steps`` steps."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return local_strategy([TrainableGroup(model, trainable, settings.learning_rate)], settings.weight_decay,
                          settings.max_grad_norm, schedule(settings, total_steps))


def schedule(settings: OptimizerConfig, total_steps: int) -> LRLambda:
    """The multiplier of the peak learning rate at each 0-based step of ``settings``' schedule over ``total_steps``
    (what a strategy's ``lr_lambda`` takes)."""

    def multiplier(step: int) -> float:
        return scheduled_learning_rate(1.0, step, settings.warmup_steps, settings.lr_schedule, total_steps)

    return multiplier


class StrategyFactory(Protocol):
    """Builds a strategy around the trained models (the default is :func:`local_strategy`)."""

    def __call__(self, groups: Sequence[TrainableGroup], weight_decay: float, max_grad_norm: float,
                 lr_lambda: LRLambda | None = None) -> Strategy:
        """AdamW per group (``learning_rate`` x ``lr_lambda(step)``), gradients clipped per group to
        ``max_grad_norm``."""


def local_optimizer(
    groups: Sequence[TrainableGroup], weight_decay: float, lr_lambda: LRLambda | None = None
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR | None]:
    """One AdamW with a parameter group per trained model, and the LR schedule (None = constant).

    torch's fused AdamW (one kernel per step, the Hugging Face Trainer's default) when every parameter is a
    floating-point CPU or CUDA tensor, its for-each implementation otherwise: the same update.
    """
    params = [p for g in groups for p in g.params]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    param_groups = [{"params": g.params, "lr": g.learning_rate} for g in groups]
    optimizer = torch.optim.AdamW(param_groups, weight_decay=weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda) if lr_lambda is not None else None
    return optimizer, scheduler


def local_strategy(groups: Sequence[TrainableGroup], weight_decay: float, max_grad_norm: float,
                   lr_lambda: LRLambda | None = None) -> LocalStrategy:
    """The one-process :class:`StrategyFactory`."""
    optimizer, scheduler = local_optimizer(groups, weight_decay, lr_lambda)
    return LocalStrategy(optimizer, scheduler, max_grad_norm, tuple(g.module for g in groups))


class LocalStrategy:
    """One process: ``loss.backward()``, per-group gradient-norm clipping, a torch optimizer and schedule."""

    rank = 0
    world_size = 1

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
                 max_grad_norm: float, modules: tuple[nn.Module, ...] = ()) -> None:
        self.optimizer, self.scheduler, self.max_grad_norm, self.modules = optimizer, scheduler, max_grad_norm, modules

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``."""
        loss.backward()

    def step(self, frozen: Sequence[int] = ()) -> tuple[float, ...]:
        """Clip each parameter group on its own (policy and value model apart), then step; a non-finite gradient
        norm drops the gradients and raises NonFiniteError instead (the weights stay as they were). A ``frozen``
        group's gradients are set to None first, so AdamW skips its parameters (no moment or step-count change)."""
        for index in frozen:
            for param in self.optimizer.param_groups[index]["params"]:
                param.grad = None
        norms = tuple(0.0 if i in frozen else float(torch.nn.utils.clip_grad_norm_(group["params"], self.max_grad_norm))
                      for i, group in enumerate(self.optimizer.param_groups))
        bad = [i for i, norm in enumerate(norms) if not math.isfinite(norm)]
        if bad:
            self.zero_grad()
            raise NonFiniteError(f"gradient norm of parameter group {bad[0]} (of {len(norms)}) is {norms[bad[0]]}")
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return norms

    def zero_grad(self) -> None:
        """Gradients to None."""
        self.optimizer.zero_grad(set_to_none=True)

    def learning_rate(self) -> float:
        """The first parameter group's current learning rate."""
        return float(self.optimizer.param_groups[0]["lr"])

    def all_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Identity: one rank."""
        return dict(values)

    def all_gather(self, obj: T) -> list[T]:
        """``[obj]``."""
        return [obj]

    def inference(self, module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """``module`` itself."""
        return contextlib.nullcontext(module)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()``."""
        return module.state_dict()

    def sampling_generator(self, generator: torch.Generator) -> torch.Generator:
        """``generator`` itself (the one-process stream is unchanged by the strategy layer)."""
        return generator

    def save_checkpoint(self, root: str | os.PathLike[str], step: int, modules: dict[str, nn.Module],
                        generator: torch.Generator, state: dict[str, Any], keep: int = 2) -> Path:
        """:func:`rlhf_core.training.checkpoint.save_checkpoint` with the scheduler state in ``state.json``."""
        if self.scheduler is not None:
            state = {**state, "scheduler": self.scheduler.state_dict()}
        return save_checkpoint(root, step, modules, self.optimizer, generator, state, keep)

    def load_checkpoint(self, path: str | os.PathLike[str], modules: dict[str, nn.Module],
                        generator: torch.Generator) -> dict[str, Any]:
        """:func:`rlhf_core.training.checkpoint.load_checkpoint` plus the scheduler."""
        saved = load_checkpoint(path, modules, self.optimizer, generator)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        return saved


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


def shard(items: Sequence[T], rank: int, world_size: int, what: str = "batch") -> Sequence[T]:
    """This rank's contiguous share of ``items``; the batch must split evenly (the caller's config checks it)."""
    if len(items) % world_size:
        raise ValueError(f"a {what} of {len(items)} does not split evenly over {world_size} processes; make it a "
                         f"multiple of the number of processes")
    size = len(items) // world_size
    return items[rank * size:(rank + 1) * size]


def weighted_shard(batch: Sequence[T], rank: int, world_size: int) -> tuple[Sequence[T], float]:
    """This rank's share of a batch that may not split evenly, and the weight of its mean loss.

    The weight ``len(share) * world_size / len(batch)`` makes the rank-average of weighted share means equal
    the mean over the whole batch (1.0 when the batch splits evenly, and always in one process). A rank left
    without rows (a short last batch) gets the batch's first row with weight 0, so its collectives still run.
    """
    base, extra = divmod(len(batch), world_size)
    start = rank * base + min(rank, extra)
    size = base + (1 if rank < extra else 0)
    if size == 0:
        return batch[:1], 0.0
    return batch[start:start + size], size * world_size / len(batch)
