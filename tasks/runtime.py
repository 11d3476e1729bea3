"""Where a stage runs its models, and where the models it is given come from.

:class:`Runtime` (device and dtype) is part of the config slice of every stage that runs a model, so its key
covers it. :func:`local_model` turns a model a config names (a folder, a ``models:/`` URI, a Hugging Face id)
into something ``from_pretrained`` loads; models that stages pass each other are artifact folders already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from tasks.run_store import Artifact
from tasks.tracking.registry import resolve_model_uri

if TYPE_CHECKING:
    from tasks.config import PipelineConfig

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    """Device and weight dtype of a stage's models."""

    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: DType = "float32"
    """Weights dtype of the loaded models."""

    @classmethod
    def of(cls, config: PipelineConfig) -> Runtime:
        return cls(config.device, config.dtype)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def local_model(ref: str) -> str:
    """A local folder (or Hugging Face id) for a model named in the config: ``models:/`` URIs are downloaded once."""
    return resolve_model_uri(ref)


@dataclass(frozen=True)
class ModelInput:
    """A model a stage reads: a folder inside an artifact, or one outside the state folder that the config named
    (a local folder, a ``models:/`` URI, a Hugging Face id) and an artifact chose. Its identity in keys is the
    artifact's (plus the folder): the artifact's own key already covers an outside model's content."""

    artifact: Artifact
    relative: str | None = None
    """Folder inside the artifact (e.g. 'proxy'); None for an outside model."""
    external: str | None = None
    """The outside model, as the config named it."""

    def identity(self) -> str:
        return f"{self.artifact.identity()}/{self.relative if self.relative is not None else 'external'}"

    @property
    def path(self) -> str:
        """A folder (or Hugging Face id) ``from_pretrained`` loads."""
        if self.relative is not None:
            return str(self.artifact.path(self.relative))
        return local_model(str(self.external))
