"""DeepSpeed JSON configs for the training loops: checks and "auto" fields (no deepspeed import needed).

``rlhf_core.distributed.zero`` builds its engines from what :func:`resolve_deepspeed_config` returns. ``"auto"`` is filled
from our settings and the model; settings the loops cannot honour (an optimizer or scheduler block, ZeRO
stages 0/1, DeepSpeed-managed gradient accumulation, fp16 loss scaling) are refused, naming the key.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel


def load_deepspeed_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed JSON config, checked for what our training loops need."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist; see infra/deepspeed/ for zero2.json and "
                                "zero3_offload.json (distributed.deepspeed_config)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}") from err
    check_config(config, str(path))
    return config


def check_config(config: dict[str, Any], source: str = "the DeepSpeed config") -> None:
    """Refuse settings the training loops cannot honour, saying which key to change."""
    for block in ("optimizer", "scheduler"):
        if block in config:
            raise ValueError(f"{source}: remove '{block}'; the optimizer (AdamW) and its schedule come from the "
                             "pipeline config (learning_rate, weight_decay, lr_schedule, warmup_steps)")
    stage = config.get("zero_optimization", {}).get("stage")
    if stage not in (2, 3):
        raise ValueError(f"{source}: zero_optimization.stage must be 2 or 3, got {stage!r}")
    if config.get("managed_gradient_accumulation", False):
        raise ValueError(f"{source}: managed_gradient_accumulation must be false (or absent); the training loops "
                         "accumulate micro-batches themselves and call step() once per mini-batch")
    if config.get("gradient_accumulation_steps", "auto") not in ("auto", 1):
        raise ValueError(f"{source}: gradient_accumulation_steps must be 'auto' or 1; set accumulation with "
                         "ppo.mini_batch_size / micro_batch_size instead")
    if config.get("fp16", {}).get("enabled", False) not in (False, "auto"):
        raise ValueError(f"{source}: fp16 needs loss scaling, which these loops do not do; use bf16 (dtype: bfloat16)")


def resolve_deepspeed_config(config: dict[str, Any], module: nn.Module, micro_batch_size: int, max_grad_norm: float,
                   world_size: int) -> dict[str, Any]:
    """A copy of ``config`` with every ``"auto"`` filled from our settings and the model.

    - ``train_micro_batch_size_per_gpu``: rows per forward on one process; ``train_batch_size``: that x
      processes (DeepSpeed uses both only for its throughput log: accumulation is ours);
    - ``gradient_accumulation_steps``: 1 and ``managed_gradient_accumulation``: false (we accumulate);
    - ``gradient_clipping``: ``max_grad_norm`` (clipped per model, each model has its own engine);
    - ``bf16.enabled``: whether the model's weights are bfloat16 (pipeline ``dtype``), and then DeepSpeed
      keeps fp32 master weights and Adam moments, unlike a bf16 model trained in one process;
    - ZeRO bucket sizes from the hidden size as Hugging Face's integration does: ``reduce_bucket_size`` =
      h^2, ``stage3_prefetch_bucket_size`` = 0.9 h^2, ``stage3_param_persistence_threshold`` = 10 h.
    """
    resolved = copy.deepcopy(config)
    micro = resolved.get("train_micro_batch_size_per_gpu", "auto")
    micro = micro_batch_size if micro == "auto" else micro
    resolved.update(train_micro_batch_size_per_gpu=micro, train_batch_size=micro * world_size,
                    gradient_accumulation_steps=1, managed_gradient_accumulation=False,
                    zero_allow_untested_optimizer=True)
    if resolved.get("gradient_clipping", "auto") == "auto":
        resolved["gradient_clipping"] = max_grad_norm
    dtype = next(module.parameters()).dtype
    for key, wanted in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if resolved.get(key, {}).get("enabled") == "auto":
            resolved[key]["enabled"] = dtype == wanted
    zero = resolved.setdefault("zero_optimization", {})
    hidden = _hidden_size(module)
    sizes = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h}
    for key, size in sizes.items():
        if zero.get(key) == "auto":
            if hidden is None:
                del zero[key]  # DeepSpeed's own default
            else:
                zero[key] = size(hidden)
    return resolved


def _hidden_size(module: nn.Module) -> int | None:
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel):
            return getattr(sub.config, "hidden_size", None)
    return None


def offloads_optimizer(config: dict[str, Any]) -> bool:
    """True when ZeRO keeps the optimizer states (and runs Adam) on the CPU."""
    return config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") == "cpu"
