"""Shared plumbing for stage tasks: device and dtype from the config, and model references."""

from __future__ import annotations

import os

import torch

from tasks.config import PipelineConfig
from tasks.tracking import resolve_model_uri

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_of(config: PipelineConfig) -> torch.device:
    """``config.device``: 'auto' picks CUDA when present, else CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def dtype_of(config: PipelineConfig) -> torch.dtype:
    """Weights dtype for loading models (``config.dtype``)."""
    return _DTYPES[config.dtype]


def local_model(ref: str, state_cache: str | os.PathLike[str] | None = None) -> str:
    """A local directory for a model reference: a path, ``models:/name@alias`` or ``models:/name/version``."""
    return resolve_model_uri(ref, cache_dir=state_cache)
