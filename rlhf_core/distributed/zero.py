"""DeepSpeed ZeRO (stage 2 or 3, optionally offloading to CPU) for reward-model and PPO training.

The only module that imports deepspeed. It provides a :class:`~rlhf_core.training.strategy.StrategyFactory`
(:class:`DeepSpeedFactory`), so ``train_reward_model`` and ``train_ppo`` run unchanged on N processes started
by ``torchrun`` or the ``deepspeed`` launcher, each calling them with the same arguments:

- each trained model (policy, value head or critic, reward model) gets its own engine, optimizer and LR
  schedule, so the per-model learning rates and gradient-norm clips of the one-process path are kept;
- micro-batch gradient accumulation is ours (``managed_gradient_accumulation: false``): DeepSpeed averages
  each rank's accumulated gradients over ranks at ``step()``; the training loops scale each rank's losses
  to its share of the batch (``rlhf_core.training.strategy``), so the update equals the one-process update;
- rollouts: each rank generates and scores its share of the prompts; under ZeRO-3 on a plain copy of the
  policy (and critic) filled from the gathered shards for the rollout phase (:meth:`DeepSpeedStrategy.inference`),
  because generation lengths differ per rank and ZeRO-3's layer-by-layer gathers are collective. Reference
  and reward models stay whole on every rank (they are not trained);
- loading: under ZeRO-3 a worker loads each model it trains inside :func:`partitioned_loading`, which builds it
  partitioned and fills the shards tensor by tensor (no rank holds the full weights at any point).

DeepSpeed configs (``infra/deepspeed/*.json``) may say ``"auto"`` where our config knows the value (see
:mod:`rlhf_core.distributed.deepspeed_config`); the optimizer and its schedule always come from our config.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

from rlhf_core.distributed.deepspeed_config import check_config, offloads_optimizer, resolve_deepspeed_config
from rlhf_core.distributed.extension_locks import clear_stale_locks
from rlhf_core.training.checkpoint import DEEPSPEED_DIR, publish, read_run_state, write_run_state
from rlhf_core.training.checkpoint_integrity import TMP_PREFIX, load_module
from rlhf_core.training.guards import NonFiniteError
from rlhf_core.training.strategy import LRLambda, TrainableGroup

T = TypeVar("T")

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int]:
    """Join the process group a launcher describes in the environment; return (rank, world size).

    ``torchrun`` and the ``deepspeed`` launcher both set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT. The backend is NCCL on GPUs and gloo on CPU (DeepSpeed's CPU accelerator), and each process
    uses the GPU of its LOCAL_RANK.
    """
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this under torchrun or the deepspeed launcher "
                           "(or set distributed.launcher, which does it for a pipeline stage)")
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        clear_stale_locks()  # a lock a killed start left would make DeepSpeed's op loads below wait forever
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(),
                                   timeout=timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


@dataclass
class DeepSpeedFactory:
    """:class:`~rlhf_core.training.strategy.StrategyFactory` that puts each trained model in its own DeepSpeed engine.

    Call :func:`init_distributed` first. With CPU offload of the optimizer, Adam is DeepSpeed's vectorised
    ``DeepSpeedCPUAdam`` (a C++ op compiled on first use, minutes, then cached in ``TORCH_EXTENSIONS_DIR``)
    unless the config says ``"zero_force_ds_cpu_optimizer": false``, which keeps torch's AdamW.
    """

    config: dict[str, Any]
    """The DeepSpeed config (as in the JSON file; "auto" fields resolved per model)."""
    micro_batch_size: int
    """Rows per forward on one process (fills ``train_micro_batch_size_per_gpu``)."""
    built: list[DeepSpeedStrategy] = field(default_factory=list, init=False)
    """Every strategy this factory made, newest last (to save what a training function trained in place)."""

    def __call__(self, groups: Sequence[TrainableGroup], weight_decay: float, max_grad_norm: float,
                 lr_lambda: LRLambda | None = None) -> DeepSpeedStrategy:
        """One engine per group, in order."""
        check_config(self.config)
        world = dist.get_world_size()
        stage3 = self.config["zero_optimization"]["stage"] == 3
        engines, shadows = [], []
        for group in groups:
            if stage3 and len(group.params) < _count(group.module):
                raise ValueError("ZeRO-3 with frozen weights in a trained model (a LoRA adapter) is not supported "
                                 "here; use infra/deepspeed/zero2.json with LoRA")
            # ZeRO-3 rollouts run on a plain copy; its structure is taken now, before the weights are sharded.
            shadows.append(_empty_copy(group.module) if stage3 else None)
            config = resolve_deepspeed_config(self.config, group.module, self.micro_batch_size, max_grad_norm, world)
            optimizer = _adam(group, weight_decay, config)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda) if lr_lambda is not None else None
            engine, *_ = deepspeed.initialize(model=group.module, optimizer=optimizer, lr_scheduler=scheduler,
                                              config=config, dist_init_required=False)
            engines.append(engine)
        self.built.append(DeepSpeedStrategy(engines, shadows))
        return self.built[-1]


@contextlib.contextmanager
def partitioned_loading(config: dict[str, Any], folder: str | os.PathLike[str],
                        dtype: torch.dtype) -> Iterator[bool]:
    """A block in which a model that will train under ``config`` is loaded (``from_pretrained`` of ``folder``);
    yields whether it comes out partitioned.

    ZeRO-3: transformers' DeepSpeed integration builds the model under ``deepspeed.zero.Init`` and loads the
    checkpoint one tensor at a time into the shards, so no rank ever holds the full weights (the engine then takes
    the model as it is). The config is resolved for this model as its engine will be (a weightless copy on the
    meta device stands in for it). ZeRO-2: nothing changes (each rank loads the whole model; the engine shards
    the optimizer). Only the trained models belong in the block: a frozen model loaded inside would be partitioned
    too, and it has no engine to gather its weights.
    """
    if config["zero_optimization"]["stage"] != 3:
        yield False
        return
    if importlib.util.find_spec("accelerate") is None:
        raise ImportError("ZeRO-3 workers load their trained models partitioned through transformers' DeepSpeed "
                          "integration, which needs accelerate: pip install accelerate (or use a ZeRO-2 config)")
    with torch.device("meta"):
        probe = AutoModel.from_config(AutoConfig.from_pretrained(str(folder))).to(dtype)
    resolved = resolve_deepspeed_config(config, probe, micro_batch_size=1, max_grad_norm=1.0, world_size=dist.get_world_size())
    hf_config = HfDeepSpeedConfig(resolved)  # transformers holds it by a weak reference: alive for the block only
    try:
        yield True
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter whose full weights are not held here now (only this rank's shard)."""
    return hasattr(param, "ds_id") and param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def _empty_copy(module: nn.Module) -> nn.Module:
    """A frozen copy of ``module``'s structure whose parameters hold no memory (filled for each rollout phase).

    The parameters are never copied (the memo hands the copy empty ones), so this works on a module partitioned at
    construction (:func:`partitioned_loading`) and costs no transient full copy."""
    memo = {id(p): nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.data.device), requires_grad=False)
            for p in module.parameters()}
    return copy.deepcopy(module, memo).requires_grad_(False)


def _release(module: nn.Module) -> None:
    for param in module.parameters():
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _count(module: nn.Module) -> int:
    return sum(1 for _ in module.parameters())


def _adam(group: TrainableGroup, weight_decay: float, config: dict[str, Any]) -> torch.optim.Optimizer:
    if offloads_optimizer(config) and config.get("zero_force_ds_cpu_optimizer", True):
        from deepspeed.ops.adam import (
            DeepSpeedCPUAdam,  # compiles its C++ op on first use
        )

        return DeepSpeedCPUAdam(group.params, lr=group.learning_rate, weight_decay=weight_decay, adamw_mode=True)
    return torch.optim.AdamW(group.params, lr=group.learning_rate, weight_decay=weight_decay)


class DeepSpeedStrategy:
    """:class:`~rlhf_core.training.strategy.Strategy` over DeepSpeed engines, one per trained model."""

    def __init__(self, engines: Sequence[DeepSpeedEngine], shadows: Sequence[nn.Module | None] = ()) -> None:
        self.engines = list(engines)
        self.modules = tuple(self.engines)
        self.shadows = list(shadows) or [None] * len(self.engines)
        """ZeRO-3: per engine, a plain copy of its module that holds full weights only during rollouts."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stage = self.engines[0].zero_optimization_stage()
        self.device = self.engines[0].device

    def backward(self, loss: torch.Tensor) -> None:
        """A plain ``loss.backward()``: the engines' hooks (their forwards ran through them) reduce the grads.

        One loss can reach several engines (a value head reads the policy's hidden states), which DeepSpeed's
        PyTorch-style backward supports; ``engine.backward`` would run only one engine's epilogue.
        """
        loss.backward()

    def step(self, frozen: Sequence[int] = ()) -> tuple[float, ...]:
        """Each engine averages its accumulated gradients over ranks, clips them to its max norm and steps; a
        ``frozen`` engine drops its gradients and is not stepped (its optimizer state stays as it was)."""
        norms = []
        for i, engine in enumerate(self.engines):
            if i in frozen:
                engine.zero_grad()
                norms.append(0.0)
                continue
            engine.step()
            norm = engine.get_global_grad_norm()  # None when the engine does not compute it
            if norm is not None and not math.isfinite(float(norm)):
                # DeepSpeed applied it (fp32 / bf16 do not skip steps): stop before the loop checkpoints the result
                raise NonFiniteError(f"gradient norm of engine {i} is {float(norm)}")
            norms.append(float(norm) if norm is not None else float("nan"))
        return tuple(norms)

    def zero_grad(self) -> None:
        """Drop every engine's accumulated gradients."""
        for engine in self.engines:
            engine.zero_grad()

    def learning_rate(self) -> float:
        """The first engine's current learning rate."""
        return float(self.engines[0].get_lr()[0])

    def all_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum over ranks, in float64."""
        keys = sorted(values)
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return dict(zip(keys, tensor.tolist(), strict=True))

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (pickled; keep it small and on the CPU)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @contextlib.contextmanager
    def inference(self, module: nn.Module) -> Iterator[nn.Module]:
        """ZeRO-2: the engine itself (whole weights on every rank). ZeRO-3: its plain copy, filled weight by
        weight from gathered shards (peak: one full copy) and emptied again when the block ends.

        Like DeepSpeed-Chat's hybrid engine and TRL's ZeRO-3 generation, rollouts need each trained model whole
        on every rank for a while; unlike ZeRO-3's own per-layer gathers they then need no other rank.
        """
        index = next((i for i, engine in enumerate(self.engines) if engine is module), None)
        shadow = self.shadows[index] if index is not None else None
        if shadow is None:
            yield module
            return
        engine = self.engines[index]
        self._at_rest()
        for source, target in zip(engine.module.parameters(), shadow.parameters(), strict=True):
            with deepspeed.zero.GatheredParameters([source], modifier_rank=None):
                target.data = source.data.detach().clone()
        try:
            yield shadow
        finally:
            _release(shadow)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's complete weights with its own keys (copied out of ZeRO-3's gathered buffers)."""
        module = _unwrap(module)
        if self.stage != 3:
            return module.state_dict()
        self._at_rest()
        with _gathered(module):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def sampling_generator(self, generator: torch.Generator) -> torch.Generator:
        """A generator seeded per rank from one draw of ``generator`` (which stays identical on every rank)."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        device = self.device if self.device.type != "cpu" else "cpu"
        return torch.Generator(device=device).manual_seed(seed + self.rank)

    def save_checkpoint(self, root: str | os.PathLike[str], step: int, modules: dict[str, nn.Module],
                        generator: torch.Generator, state: dict[str, Any], keep: int = 2) -> Path:
        """Weights (whole, safetensors, by rank 0) + each engine's ZeRO shards (every rank) + run state; the newest
        ``keep`` checkpoints under ``root`` stay.

        ``root`` must be on storage every rank sees (one machine, or a shared file system across nodes).
        """
        root = Path(root)
        final = root / f"step_{step:06d}"
        tmp = root / f"{TMP_PREFIX}{step:06d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        for stem, module in modules.items():
            self.save_weights(module, tmp / f"{stem}.safetensors")
        for index, engine in enumerate(self.engines):
            engine.save_checkpoint(str(tmp / DEEPSPEED_DIR / f"engine{index}"), tag="state")
        dist.barrier()
        if self.rank == 0:
            write_run_state(tmp, step, generator, state)
            publish(root, tmp, final.name, keep)
        dist.barrier()
        return final

    def load_checkpoint(self, path: str | os.PathLike[str], modules: dict[str, nn.Module],
                        generator: torch.Generator) -> dict[str, Any]:
        """Engines from their ZeRO shards (weights, optimizer, schedule); other modules from safetensors."""
        path = Path(path)
        shards = path / DEEPSPEED_DIR
        if not shards.is_dir():
            raise FileNotFoundError(
                f"checkpoint {path} was written by a one-process run (no {DEEPSPEED_DIR}/ with ZeRO shards): resume "
                "it without distributed settings, or delete the checkpoints to start the stage over")
        for index, engine in enumerate(self.engines):
            folder = shards / f"engine{index}"
            loaded, _ = engine.load_checkpoint(str(folder), tag="state", load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
            if loaded is None:
                raise FileNotFoundError(f"checkpoint {folder} holds no DeepSpeed state for engine {index}; it was "
                                        "written with other model roles or another number of trained models")
        engines = {id(e) for e in self.engines}
        for stem, module in modules.items():
            if id(module) not in engines:
                load_module(module, path / f"{stem}.safetensors")
        return read_run_state(path, generator)

    def save_weights(self, module: nn.Module, path: str | os.PathLike[str]) -> None:
        """Rank 0 writes ``module``'s complete weights (an engine, or a model trained in place inside one) as
        safetensors, laid out as ``safetensors.torch.save_model`` does. Every rank must call it (ZeRO-3)."""
        self._at_rest()
        with _gathered(module):
            if self.rank == 0:
                _save_whole(module, path)

    def _at_rest(self) -> None:
        """ZeRO-3 prefetches the next forward's weights asynchronously; wait for those gathers and release
        everything, so that gathering weights outside a forward starts from partitioned weights only."""
        if self.stage == 3:
            for engine in self.engines:
                engine.empty_partition_cache()

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _save_whole(module: nn.Module, path: str | os.PathLike[str]) -> None:
    """ZeRO-2 keeps the weights as views into one flat buffer per engine, which ``save_model`` refuses, so
    they are copied out; tied weights stay one tensor, under the alphabetically first of their names, as
    ``save_model`` does (so ``load_model`` reads the file like any other)."""
    names: dict[tuple[int, int], list[str]] = {}
    tensors: dict[tuple[int, int], torch.Tensor] = {}
    for name, tensor in _unwrap(module).state_dict().items():
        key = (tensor.data_ptr(), tensor.numel()) if tensor.numel() else (id(name), 0)
        names.setdefault(key, []).append(name)
        tensors.setdefault(key, tensor)
    state = {sorted(group)[0]: tensors[key].detach().to("cpu", copy=True).contiguous() for key, group in names.items()}
    save_file(state, str(path), metadata={"format": "pt"})


def _gathered(module: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """A block in which ``module``'s ZeRO-3 shards are gathered into full weights on every rank (read-only, no
    forwards inside: ZeRO-3's forward hooks would release them); collective. Other modules are left alone."""
    return deepspeed.zero.GatheredParameters(list(_unwrap(module).parameters()), modifier_rank=None)


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DeepSpeedEngine) else module
