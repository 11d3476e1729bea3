"""Stage cache keys: stage name + the config sections it reads + digests of its input files + code version.

Prefect persists each stage's result under its key (in the state directory), so a stage whose inputs and
config are unchanged is skipped — also in a later process (``rlhf resume``, or a rerun of the same config).
Run-specific parameters (the output folder, the MLflow parent run) never enter a key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.typed_yaml import config_to_dict

#: Parameters that name where a run writes, not what it computes.
RUN_SPECIFIC = frozenset({"out_dir", "parent_run_id"})
#: Files larger than this are identified by size and mtime instead of content (multi-GB checkpoints).
CONTENT_HASH_LIMIT = 256 * 1024 * 1024
CODE_PACKAGES = ("rlhf_core", "tasks")


@lru_cache(maxsize=1)
def code_version() -> str:
    """Digest of every .py file of the algorithm and task packages: any code change invalidates caches."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    if size > CONTENT_HASH_LIMIT:
        return f"size={size};mtime={path.stat().st_mtime_ns}"
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def path_digest(path: str | os.PathLike[str]) -> str:
    """Content digest of a file, or of every file under a folder (relative names included)."""
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    digest = hashlib.sha256()
    for child in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp")):
        digest.update(str(child.relative_to(path)).encode())
        digest.update(_file_digest(child).encode())
    return digest.hexdigest()


def _canonical(value: Any) -> Any:
    """JSON-able form of a parameter; existing local paths are replaced by their content digest."""
    if isinstance(value, PipelineConfig):
        return config_to_dict(value)
    if is_dataclass(value) and not isinstance(value, type):
        return _canonical(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, str) and not value.startswith("models:/") and os.path.exists(value):
        return {"digest": path_digest(value)}
    return value


def stage_key(stage: str, sections: Mapping[str, Any], inputs: Mapping[str, Any]) -> str:
    """The cache key of one stage call."""
    payload = {
        "stage": stage,
        "code": code_version(),
        "config": _canonical(sections),
        "inputs": {k: _canonical(v) for k, v in sorted(inputs.items()) if k not in RUN_SPECIFIC},
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def config_sections(config: PipelineConfig, names: Iterable[str]) -> dict[str, Any]:
    """Selected config sections (dotted paths such as ``ppo.generation`` reach inside one), plus the seed,
    device and dtype, which every stage uses."""
    full = config_to_dict(config)
    selected = {"seed": full["seed"], "device": full["device"], "dtype": full["dtype"]}
    for name in names:
        value: Any = full
        for part in name.split("."):
            value = value[part]
        selected[name] = value
    return selected


def cache_key_fn(stage: str, sections: Iterable[str]) -> Callable[[Any, dict[str, Any]], str]:
    """A Prefect ``cache_key_fn`` for a task whose ``config`` parameter is the PipelineConfig."""
    names = tuple(sections)

    def key(_context: Any, parameters: dict[str, Any]) -> str:
        config = parameters["config"]
        inputs = {k: v for k, v in parameters.items() if k != "config"}
        return stage_key(stage, config_sections(config, names), inputs)

    return key
