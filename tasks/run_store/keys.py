"""Artifact keys: a digest of exactly what a stage is given, derived from its typed config slice and its inputs.

    key = sha256(stage name, code version, canonical(config slice), identities of the inputs[, rerun number])

The code version is a digest of the stage's module and the project modules it imports, comments and docstrings left
out (:mod:`tasks.run_store.code_digest`): a documentation edit reruns nothing, a code change reruns the stages that
run it and, through their inputs, those downstream.

Nothing is listed by hand: the config part is the whole slice object the stage function receives (every field
of it, recursively), so a setting the stage can read is in its key and a setting it cannot read is not.
Inputs are other artifacts (identified by their own key, which already covers everything upstream) or files
outside the state folder (identified by their content). Config fields that name local files are declared with
:data:`LocalPath` / :data:`ModelSource` and enter the key by content too, so editing a data file reruns data-prep.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from rlhf_core.ranges import is_retention
from tasks.run_store.code_digest import closure, code_digest, module_file, package_modules

KEY_LENGTH = 20
"""Hex digits of a key (80 bits)."""
CONTENT_HASH_LIMIT = 256 * 1024 * 1024
"""Files larger than this are identified by size and modification time instead of content (multi-GB weights)."""
CODE_PACKAGES = ("rlhf_core", "tasks")
"""Packages whose source is part of every key: a code change reruns what it may change."""


class _PathMark:
    """Marks a config field whose value names a local file or folder (or a URI)."""

    def __repr__(self) -> str:
        return "LocalPath"


class _ModelMark(_PathMark):
    """Marks a config field that names a model: a local folder, a ``models:/`` URI or a Hugging Face id."""

    def __repr__(self) -> str:
        return "ModelSource"


PATH_MARK, MODEL_MARK = _PathMark(), _ModelMark()
LocalPath = Annotated[str, PATH_MARK]
"""A config value naming a local file or folder (or a URI): it enters keys by content."""
ModelSource = Annotated[str, MODEL_MARK]
"""A config value naming a model; a local folder enters keys by content, a ``models:/`` URI by registry version."""

ModelResolver = Callable[[str], str]
"""Identity of a ``models:/`` URI (e.g. 'models:/rm/3 <source>'), given by the tracking adapter."""


CODE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout whose ``CODE_PACKAGES`` the code versions read."""


@lru_cache(maxsize=None)
def code_version(module: str | None = None) -> str:
    """Digest of the code ``module`` runs: it and every module of ``CODE_PACKAGES`` it reaches through imports
    (:mod:`tasks.run_store.code_digest`; comments and docstrings left out). None: every module of the packages (a
    run's ``rlhf.code_version`` tag)."""
    if module is None or module_file(CODE_ROOT, module) is None:  # a stage defined outside the checkout: all of it
        return code_digest(CODE_ROOT, package_modules(CODE_ROOT, CODE_PACKAGES))
    return code_digest(CODE_ROOT, sorted(closure(CODE_ROOT, module, CODE_PACKAGES)))


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (size and mtime beyond ``CONTENT_HASH_LIMIT``)."""
    stat = path.stat()
    if stat.st_size > CONTENT_HASH_LIMIT:
        return f"size={stat.st_size};mtime={stat.st_mtime_ns}"
    return sha256_file(path)


def path_digest(path: str | os.PathLike[str]) -> str:
    """Digest of a file, or of every file under a folder (names included)."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    digest = hashlib.sha256()
    for child in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(child.relative_to(path).as_posix().encode())
        digest.update(file_digest(child).encode())
    return digest.hexdigest()


def external_identity(value: str, model: bool, resolve_model: ModelResolver | None) -> Any:
    """How a path-like config value enters a key: content digest when it exists locally, the registry version for
    a ``models:/`` URI, else the text itself (a Hugging Face id, a remote URI, 'sft', 'scratch')."""
    if model and value.startswith("models:/"):
        return resolve_model(value) if resolve_model is not None else value
    if "://" not in value and os.path.exists(value):
        return {"path": value, "digest": path_digest(value)}
    return value


def _marks(hint: Any) -> _PathMark | None:
    """The path mark inside a type hint (``LocalPath``, ``LocalPath | None``, ``tuple[LocalPath, ...]``)."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in typing.get_args(hint)[1:] if isinstance(m, _PathMark)), None)
    for arg in typing.get_args(hint):
        found = _marks(arg)
        if found is not None:
            return found
    return None


@lru_cache(maxsize=None)
def _field_marks(cls: type) -> dict[str, _PathMark]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: mark for f in dataclasses.fields(cls) if (mark := _marks(hints[f.name])) is not None}


@lru_cache(maxsize=None)
def _retention_fields(cls: type) -> frozenset[str]:
    """Fields that only say how much is kept on disk (``rlhf_core.ranges.Retention``): never part of a key."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return frozenset(f.name for f in dataclasses.fields(cls) if is_retention(hints[f.name]))


def path_settings(config: Any, prefix: str = "") -> list[tuple[str, Any, bool]]:
    """(dotted key, value, names a model) of every ``LocalPath`` / ``ModelSource`` setting that is set."""
    found: list[tuple[str, Any, bool]] = []
    marks = _field_marks(type(config))
    for f in dataclasses.fields(config):
        value, key = getattr(config, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found.extend(path_settings(value, f"{key}."))
        elif f.name in marks and value not in (None, (), []):
            found.append((key, value, isinstance(marks[f.name], _ModelMark)))
    return found


def relative_paths(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every ``LocalPath`` / ``ModelSource`` setting that names a relative local path (a
    model setting only when such a path exists; a list when any of its items does): what another working folder
    would read differently."""
    found: dict[str, Any] = {}
    marks = _field_marks(type(config))
    for f in dataclasses.fields(config):
        value, key = getattr(config, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found.update(relative_paths(value, f"{key}."))
        elif f.name in marks and any(_is_relative_path(item, marks[f.name])
                                     for item in (value if isinstance(value, (list, tuple)) else [value])):
            found[key] = value
    return found


def _is_relative_path(item: Any, mark: _PathMark) -> bool:
    relative = isinstance(item, str) and "://" not in item and not os.path.isabs(item)
    return relative and (not isinstance(mark, _ModelMark) or os.path.exists(item))


def canonical(value: Any, resolve_model: ModelResolver | None = None, mark: _PathMark | None = None) -> Any:
    """JSON-able, order-independent form of a config slice or an input, with local paths replaced by content."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        identity = getattr(value, "identity", None)
        if callable(identity):  # an artifact handle (or anything that names itself)
            return identity()
        marks, kept = _field_marks(type(value)), _retention_fields(type(value))
        return {f.name: canonical(getattr(value, f.name), resolve_model, marks.get(f.name))
                for f in dataclasses.fields(value) if f.name not in kept}
    if isinstance(value, Mapping):
        return {str(k): canonical(v, resolve_model, mark) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v, resolve_model, mark) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, str) and mark is not None:
        return external_identity(value, isinstance(mark, _ModelMark), resolve_model)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    identity = getattr(value, "identity", None)
    if callable(identity):
        return identity()
    raise TypeError(f"cannot put a {type(value).__name__} into an artifact key: {value!r}")


def stage_key(stage: str, config: Any, inputs: Mapping[str, Any], rerun: int = 0,
              resolve_model: ModelResolver | None = None, module: str | None = None) -> str:
    """The artifact key of one stage call. ``rerun`` > 0 (``rlhf stage``) gives a fresh key for the same work;
    ``module``: the stage's module, whose code (with what it imports) enters the key (None: all the packages')."""
    payload = {"stage": stage, "code": code_version(module), "config": canonical(config, resolve_model),
               "inputs": canonical(dict(inputs), resolve_model)}
    if rerun:
        payload["rerun"] = rerun
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_LENGTH]
