"""Checks of a resolved config against this machine, before any stage runs: the files it names exist (and a
DeepSpeed config is one the loops can honour), every model it names can be had and is of the right kind
(``tasks.preflight_models``), its device exists, its precision settings fit together and its lengths fit the model.

Range and type rules hold while the config is built (``tasks.typed_yaml``, ``rlhf_core.ranges``); these need
the file system, the network or the hardware, so :func:`resolve_config` runs them once, with each value's
source: every refusal is one line naming the dotted key, the value, where it came from and what would be valid.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from rlhf_core.models.families import config_positions
from rlhf_core.models.lm import model_size
from tasks.config import PipelineConfig, load_config_with_origins
from tasks.preflight_models import (MODEL_WORDS, POLICY_KEY, ModelsAtHand, check_model_kinds, hub_cache, model_folder,
                                    preflight_critic, require_exists)
from tasks.run_store.keys import path_settings
from tasks.typed_yaml import ConfigError, bad_value, source_of

__all__ = ["check_environment", "hub_cache", "resolve_config"]


def resolve_config(path: str | Path | None = None, preset: str | None = None,
                   overrides: Sequence[str] = ()) -> PipelineConfig:
    """:func:`tasks.config.load_config`, then the checks that need this machine (:func:`check_environment`: files,
    device, precision, lengths): what every command that starts or continues a run uses, before any stage runs."""
    config, origins = load_config_with_origins(path, preset, overrides)
    check_environment(config, origins)
    return config


def check_environment(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    """ConfigError (one line) for the first setting this machine cannot honour."""
    models = _check_paths(config, origins)
    check_model_kinds(models)
    preflight_critic(config, origins, models)
    _check_deepspeed(config, origins)
    _check_device(config, origins)
    _check_precision(config, origins)
    _check_positions(config, origins, models)


def _check_paths(config: PipelineConfig, origins: Mapping[str, str]) -> ModelsAtHand:
    models = ModelsAtHand(origins)
    for key, value, model in path_settings(config):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, str) or "://" in item or item.startswith("models:/"):
                continue  # a URI: the stage that reads it says what is wrong with it
            if not model:
                require_exists(key, item, origins)
            elif item not in MODEL_WORDS:
                folder = model_folder(key, item, origins)
                if folder is not None:
                    models.folders[key] = (item, folder)
    hostfile = config.distributed.hostfile
    if hostfile is not None:
        require_exists("distributed.hostfile", hostfile, origins)
    return models


# --------------------------------------------------------------------------------------------- hardware


def _check_deepspeed(config: PipelineConfig, origins: Mapping[str, str]) -> None:
    from rlhf_core.distributed.deepspeed_config import load_deepspeed_config

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


def _check_positions(config: PipelineConfig, origins: Mapping[str, str], models: ModelsAtHand) -> None:
    """A reply of ppo.generation.max_new_tokens must leave room for a prompt within the policy's positions."""
    positions, model = _policy_positions(config, models)
    if positions is None:
        return
    key = "ppo.generation.max_new_tokens"
    if config.ppo.generation.max_new_tokens >= positions:
        raise bad_value(key, config.ppo.generation.max_new_tokens, origins,
                        f"must be < the {positions} positions of {model} (a prompt needs room too)")
    # data.prep.max_prompt_length counts the base model's tokens (data-prep loads its tokenizer), else characters
    prompt, reply = config.data.prep.max_prompt_length, config.ppo.generation.max_new_tokens
    if config.sft.base_model is not None and prompt is not None and prompt + reply > positions:
        raise bad_value("data.prep.max_prompt_length", prompt, origins, f"+ {key} ({reply}) must be <= the "
                        f"{positions} positions of {model}, or PPO refuses the longest prompts data-prep keeps")


def _policy_positions(config: PipelineConfig, models: ModelsAtHand) -> tuple[int | None, str]:
    base = config.sft.base_model
    if base is None:
        size = config.sft.model_size
        return (model_size(size) if isinstance(size, str) else size).n_positions, f"model_size {size!r}"
    if POLICY_KEY not in models.folders:
        return None, base  # a registry URI or a hub id still to download: checked when it is loaded
    return config_positions(models.config(POLICY_KEY)), f"sft.base_model {base!r}"
