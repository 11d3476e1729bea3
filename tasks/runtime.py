"""Shared plumbing for stage tasks: device and dtype from the config, stage folders, model references."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

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


def stage_dir(run_dir: str | os.PathLike[str], stage: str) -> Path:
    """``<run_dir>/<stage>``, created."""
    path = Path(run_dir) / stage
    path.mkdir(parents=True, exist_ok=True)
    return path


def local_model(ref: str, state_cache: str | os.PathLike[str] | None = None) -> str:
    """A local directory for a model reference: a path, ``models:/name@alias`` or ``models:/name/version``."""
    return resolve_model_uri(ref, cache_dir=state_cache)


def save_model_dir_atomically(save: callable, target: str | os.PathLike[str]) -> Path:
    """Call ``save(tmp_dir)`` (e.g. ``model.save_pretrained``) and move the folder into place only when complete."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        save(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
