"""Checks of a resolved config against this machine, before any stage runs: the files it names exist (and a
DeepSpeed config is one the loops can honour), its device exists, its precision settings fit together and
its lengths fit the model.

Range and type rules hold while the config is built (``tasks.typed_yaml``, ``rlhf_core.ranges``); these need
the file system or the hardware, so ``tasks.config.resolve_config`` runs them once, with each value's source:
every refusal is one line naming the dotted key, the value, where it came from and what would be valid.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhf_core.models.lm import model_size
from tasks.run_store.keys import path_settings
from tasks.typed_yaml import ConfigError, bad_value, source_of

if TYPE_CHECKING:
    from tasks.config import PipelineConfig

_MODEL_WORDS = ("sft", "scratch")
"""ModelSource values that name no file (reward_model.init)."""


def check_environment(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    """ConfigError (one line) for the first setting this machine cannot honour."""
    _check_paths(config, origins)
    _check_deepspeed(config, origins)
    _check_device(config, origins)
    _check_precision(config, origins)
    _check_positions(config, origins)


def _check_paths(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    for key, value, model in path_settings(config):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, str) or "://" in item or item.startswith("models:/"):
                continue  # a URI: the stage that reads it says what is wrong with it
            if model and (item in _MODEL_WORDS or not _looks_local(item)):
                continue  # a Hugging Face id: resolved when the model is loaded
            _require_exists(key, item, origins)
    hostfile = config.distributed.hostfile
    if hostfile is not None:
        _require_exists("distributed.hostfile", hostfile, origins)


def _looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.path.exists(value)


def _require_exists(key: str, value: str, origins: Mapping[str, str]) -> None:
    path = Path(value).expanduser()
    if "{iteration}" in value:  # a file per iteration, written later (refresh.labels_file): its folder must exist
        folder = Path(value.split("{iteration}")[0]).expanduser()
        folder = folder if value.split("{iteration}")[0].endswith(("/", os.sep)) else folder.parent
        if not folder.is_dir():
            raise bad_value(key, value, origins, f"its folder {folder.resolve()} does not exist")
        return
    if not path.exists():
        raise bad_value(key, value, origins, f"no such file or folder (looked in {path.resolve()})")


def _check_deepspeed(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    from rlhf_core.distributed.deepspeed_config import load_config as load_deepspeed_config

    distributed = config.distributed
    if distributed.deepspeed_config is None:
        return
    key = "distributed.deepspeed_config"
    try:
        ds = load_deepspeed_config(distributed.deepspeed_config)
    except (OSError, ValueError) as err:
        raise bad_value(key, distributed.deepspeed_config, origins, str(err)) from None
    if ds.get("zero_optimization", {}).get("stage") != 3:
        return
    lora = {"ppo.lora.enabled": distributed.runs("ppo-iteration") and config.ppo.lora.enabled,
            "reward_model.training.lora.enabled": (distributed.runs("reward-model")
                                                   and config.reward_model.training.lora.enabled),
            "reward_model.heldout.lora.enabled": (distributed.runs("reward-model")
                                                  and config.reward_model.heldout.lora.enabled)}
    both = [name for name, enabled in lora.items() if enabled]
    if both:
        raise ConfigError(f"{both[0]}=true with ZeRO-3 ({key}={distributed.deepspeed_config!r}, from "
                          f"{source_of(key, origins)}): ZeRO-3 cannot shard a model with frozen weights; use "
                          "infra/deepspeed/zero2.json with LoRA")


def _check_device(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    device = config.device
    if device in ("auto", "cpu"):
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise bad_value("device", device, origins, "not a torch device; use auto, cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise bad_value("device", device, origins, "this machine has no CUDA device; use auto or cpu")
        if parsed.index is not None and parsed.index >= count:
            names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            raise bad_value("device", device, origins, f"this machine has {count} CUDA device"
                                                       f"{'s' if count > 1 else ''}: {names}")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise bad_value("device", device, origins, "MPS is not available on this machine; use auto or cpu")
    elif parsed.type not in ("cuda", "mps"):
        raise bad_value("device", device, origins, "use auto, cpu, cuda, cuda:N or mps")


def _check_precision(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    for key, autocast in _autocasts(config):
        if autocast != "bf16":
            continue
        if config.dtype == "float16":
            raise ConfigError(f"{key}='bf16' with dtype='float16' (from {source_of('dtype', origins)}): bf16 autocast "
                              "over float16 weights mixes two half formats; use dtype float32 or bfloat16")
        cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
        if cuda and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise bad_value(key, autocast, origins, "this GPU has no bf16 support; use 'none'")


def _autocasts(config: PipelineConfig) -> Iterator[tuple[str, str]]:
    yield "ppo.autocast", config.ppo.autocast
    yield "reward_model.training.autocast", config.reward_model.training.autocast
    yield "reward_model.heldout.autocast", config.reward_model.heldout.autocast


def _check_positions(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    """A reply of ppo.generation.max_new_tokens must leave room for a prompt within the policy's positions."""
    positions, model = _policy_positions(config)
    if positions is None:
        return
    key = "ppo.generation.max_new_tokens"
    if config.ppo.generation.max_new_tokens >= positions:
        raise bad_value(key, config.ppo.generation.max_new_tokens, origins,
                        f"must be < the {positions} positions of {model} (a prompt needs room too)")


def _policy_positions(config: PipelineConfig) -> tuple[int | None, str]:
    base = config.sft.base_model
    if base is None:
        size = config.sft.model_size
        return (model_size(size) if isinstance(size, str) else size).n_positions, f"model_size {size!r}"
    config_file = Path(base).expanduser() / "config.json"
    if not config_file.is_file():
        return None, base  # a Hugging Face id or a registry URI: checked when it is loaded
    try:
        data: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_file} (sft.base_model) is not a readable model config: {err}") from None
    positions = data.get("n_positions") or data.get("max_position_embeddings")
    return (int(positions) if isinstance(positions, int) else None), f"sft.base_model {base!r}"
