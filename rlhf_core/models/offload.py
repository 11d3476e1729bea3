"""Frozen networks in host memory while trained models train (``ppo.offload_frozen``).

A PPO step needs the frozen reference and reward model on the accelerator only while it collects experience
(reference log-probs, scores); while the policy and value model train they would hold their weights there for
nothing (~15 GB each for a 7B model in bf16). :func:`offload_plan` picks the frozen networks that can leave: a
network that owns no weights (the LoRA reference = the policy with its adapter disabled) has nothing to move, and
one that shares a weight tensor with a trained model (the reward model under a LoRA critic) must stay, or the
trained model would lose its base weights. Sharing is read from the tensors themselves (object identity and
storage), never from settings. :func:`parked` holds the chosen networks in host memory for a block.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlhf_core.models.scoring import EnsembleScorer, Scorer, WeightedSum

HOST = torch.device("cpu")

#: Why a frozen network stays on its device (:attr:`OffloadPlan.kept`).
OWNS_NO_WEIGHTS = "owns no weights (a LoRA reference runs the policy's base with the adapter disabled)"
SHARES_WEIGHTS = "shares weights with a trained model (a LoRA critic adapts the reward model's weights)"


@dataclass(frozen=True)
class OffloadPlan:
    """Which frozen networks go to host memory while trained models train, and why the others stay."""

    moved: dict[str, nn.Module]
    """Role name -> network that is parked in host memory during training."""
    kept: dict[str, str]
    """Role name -> why it stays on its device."""

    def describe(self) -> str:
        """One line for the log: what moves, what stays and why."""
        moved = ", ".join(self.moved) or "nothing"
        kept = "; ".join(f"{role} stays: {why}" for role, why in self.kept.items())
        return f"in host memory while training: {moved}" + (f"; {kept}" if kept else "")


def scorer_networks(scorer: Scorer) -> dict[str, nn.Module]:
    """The networks a scorer runs, by name: a reward-model scorer's ``model``, those of each part of a
    :class:`WeightedSum` and each member of an :class:`EnsembleScorer`; none for a rule-based scorer."""
    if isinstance(scorer, WeightedSum):
        return {f"{name} (part {i})": net for i, (part, _) in enumerate(scorer.parts)
                for name, net in scorer_networks(part).items()}
    if isinstance(scorer, EnsembleScorer):
        return {f"{name} (member {i})": net for i, member in enumerate(scorer.members)
                for name, net in scorer_networks(member).items()}
    model = getattr(scorer, "model", None)
    return {"reward model": model} if isinstance(model, nn.Module) else {}


def offload_plan(frozen: Mapping[str, nn.Module | None], trained: Sequence[nn.Module | None]) -> OffloadPlan:
    """Of the ``frozen`` networks (role -> module; None = absent), those that own weights and share none with a
    ``trained`` module (a DeepSpeed engine counts through the module it wraps)."""
    trained_tensors = [t for module in trained if module is not None for t in _tensors(module)]
    taken_ids = {id(t) for t in trained_tensors}
    taken_storage = {_storage(t) for t in trained_tensors if t.numel()}
    moved: dict[str, nn.Module] = {}
    kept: dict[str, str] = {}
    for role, module in frozen.items():
        if module is None:
            continue
        tensors = [t for t in _tensors(module) if t.numel()]
        if not tensors:
            kept[role] = OWNS_NO_WEIGHTS
        elif any(id(t) in taken_ids or _storage(t) in taken_storage for t in tensors):
            kept[role] = SHARES_WEIGHTS
        else:
            moved[role] = module
    return OffloadPlan(moved, kept)


@contextlib.contextmanager
def parked(modules: Sequence[nn.Module], park: torch.device | None = None) -> Iterator[None]:
    """Hold ``modules`` on ``park`` (None = :data:`HOST`) for the block, then put each back on the device it was on
    (also when the block fails). Parameters stay the same objects (tied weights stay tied); only their storage
    moves. When a module left a CUDA device, the allocator's cache is emptied so that the memory is really free
    (for the training's activations and for other processes). Weights changed while parked (a ``load_state_dict``)
    come back changed."""
    park = HOST if park is None else park
    homes = [_device(module) for module in modules]
    for module in modules:
        move(module, park)
    if any(home.type == "cuda" for home in homes):
        torch.cuda.empty_cache()
    try:
        yield
    finally:
        for module, home in zip(modules, homes, strict=True):
            move(module, home)


def move(module: nn.Module, device: torch.device) -> None:
    """``module``'s parameters and buffers to ``device``, in place (a no-op when they are there)."""
    module.to(device)


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(), module.buffers())


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _device(module: nn.Module) -> torch.device:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first.device if first is not None else HOST
