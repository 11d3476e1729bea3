"""Per-GPU bytes of trained and frozen models: weights, gradients, optimizer state, ZeRO sharding, offload.

Sources in :mod:`benchmarks.memory.calculator`'s docstring (ZeRO paper sec. 3.1; DeepSpeed's bf16 optimizer and
ZeRO stages keep an fp32 gradient (partition) too; pinned host memory of offload).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.memory.shapes import (
    ModelShape,
    RunShape,
    block_parameters,
    causal_lm_parameters,
    largest_tensor,
    lora_parameters,
    reward_model_parameters,
)


@dataclass(frozen=True)
class TrainedState:
    """Per-GPU bytes of one trained model at three moments: backward, optimizer step, between updates."""

    weights: int
    """The model's weights held on the GPU (its shard under ZeRO-3, none under offload)."""
    gradients: int
    """Gradients while micro-batches accumulate (ZeRO-2/3: the rank's bf16 partition; DeepSpeed bf16 without
    ZeRO: bf16 + its persistent fp32 buffer)."""
    step_gradients: int
    """Gradients during the optimizer step: DeepSpeed ZeRO-1/2/3 cast the rank's partition to fp32 for the step,
    after freeing the bf16 one, and free it after (``stage_1_and_2.py``, ``stage3.py _release_sub_group``)."""
    idle_gradients: int
    """Gradients between updates (rollout, scoring): torch keeps them until the next ``zero_grad``; ZeRO-2/3
    have freed theirs; DeepSpeed bf16 without ZeRO keeps its fp32 buffer."""
    optimizer: int
    """fp32 master weights and Adam's m, v (torch AdamW: the two moments in the weights' dtype)."""
    gathered: int
    """ZeRO-3 only: layers gathered whole for the current forward/backward (bf16)."""
    host: int
    """Offload only: pinned host bytes of this rank (weights 2, fp32 gradients 4, master + Adam 12 per param)."""

    @property
    def training(self) -> int:
        """GPU bytes during forward/backward."""
        return self.weights + self.gradients + self.optimizer + self.gathered

    @property
    def step(self) -> int:
        """GPU bytes during the optimizer step (activations are freed by then)."""
        return self.weights + self.step_gradients + self.optimizer

    @property
    def idle(self) -> int:
        """GPU bytes between updates."""
        return self.weights + self.idle_gradients + self.optimizer


NO_STATE = TrainedState(0, 0, 0, 0, 0, 0, 0)


def trained_state(params: int, shape: ModelShape, run: RunShape) -> TrainedState:
    """Weights, gradients and optimizer state of ``params`` trained parameters on one GPU (see module docstring)."""
    wb, n = run.weight_bytes, run.gpus
    if run.optimizer == "torch":
        return TrainedState(wb * params, wb * params, wb * params, wb * params, 2 * wb * params, 0, 0)
    mixed = wb != 4  # bf16 weights: DeepSpeed adds fp32 master weights and fp32 gradients
    if run.zero_stage == 0:  # runtime/bf16_optimizer.py: a persistent fp32 gradient buffer
        grads, fp32 = (wb + 4) * params if mixed else wb * params, 4 * params if mixed else wb * params
        return TrainedState(wb * params, grads, grads, fp32, (12 if mixed else 8) * params, 0, 0)
    if run.offload:
        gathered = wb * (largest_tensor(shape) + block_parameters(shape))
        return TrainedState(0, wb * shape.hidden ** 2, 0, 0, 0, gathered, (wb + 4 + 12) * params // n)
    weights = wb * params if run.zero_stage == 2 else wb * params // n
    gathered = wb * (largest_tensor(shape) + block_parameters(shape)) if run.zero_stage == 3 else 0
    return TrainedState(weights, wb * params // n, 4 * params // n, 0, 12 * params // n, gathered, 0)


def adapter_state(params: int) -> TrainedState:
    """fp32 LoRA adapters and heads under torch AdamW: 4 + 4 + 8 bytes per parameter."""
    return TrainedState(4 * params, 4 * params, 4 * params, 4 * params, 8 * params, 0, 0)


@dataclass(frozen=True)
class Roles:
    """Per-GPU bytes of the four PPO roles' weights and trained state, by what they are."""

    frozen: int
    """Frozen weights: the reference (or the LoRA base it shares with the policy) and the reward model."""
    policy: TrainedState
    """The policy (full) or its adapter (LoRA; its base is in ``frozen``)."""
    value: TrainedState
    """The critic (full or LoRA adapter + score head), the value head, or nothing."""
    rollout_copies: int
    """ZeRO-3: whole bf16 copies of the trained models during rollout and scoring (``strategy.inference``)."""
    parked: int = 0
    """Of ``frozen``, what ``ppo.offload_frozen`` holds in host memory during training and the optimizer step."""


def roles(shape: ModelShape, run: RunShape) -> Roles:
    """What the four roles hold on one GPU for ``run``'s setup."""
    wb, psi_p, psi_r = run.weight_bytes, causal_lm_parameters(shape), reward_model_parameters(shape)
    none = NO_STATE
    if run.lora_rank:  # reference = policy base with the adapter off; critic = adapter on the scorer's base
        value = {"critic": adapter_state(lora_parameters(shape, run.lora_rank) + shape.hidden),
                 "head": adapter_state(shape.hidden + 1), "none": none}[run.value_model]
        parked = wb * psi_r if run.offload_frozen and run.value_model != "critic" else 0
        return Roles(wb * (psi_p + psi_r), adapter_state(lora_parameters(shape, run.lora_rank)), value, 0, parked)
    critic = run.value_model == "critic"
    value = {"critic": trained_state(psi_r, shape, run), "head": adapter_state(shape.hidden + 1),
             "none": none}[run.value_model]
    copies = wb * (psi_p + (psi_r if critic else 0)) if run.zero_stage == 3 else 0
    parked = wb * (psi_p + psi_r) if run.offload_frozen else 0
    return Roles(wb * (psi_p + psi_r), trained_state(psi_p, shape, run), value, copies, parked)


def reward_model_state(shape: ModelShape, run: RunShape) -> tuple[int, int]:
    """GPU bytes of the reward-model stage's trained model during backward and during the optimizer step: a LoRA
    adapter + score head over frozen weights, or the whole model trained as ``run`` trains full models."""
    psi_r = reward_model_parameters(shape)
    if run.lora_rank:
        adapter = adapter_state(lora_parameters(shape, run.lora_rank) + shape.hidden)
        return run.weight_bytes * psi_r + adapter.training, run.weight_bytes * psi_r + adapter.step
    state = trained_state(psi_r, shape, run)
    return state.training, state.step
