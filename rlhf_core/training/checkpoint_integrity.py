"""Checkpoint integrity: a manifest seals each checkpoint folder, and a resume trusts only what it verifies.

``manifest.json`` lists the step and every file of the folder (sub-folders included, such as DeepSpeed's
``deepspeed/``) with its size and sha256. It is written last, just before the folder gets its final name, so a
folder whose files all match it holds exactly what the run wrote: a flipped byte, a truncated optimizer file or
an edited ``state.json`` fails verification, and the resume falls back to an earlier checkpoint instead of
continuing from different numbers. Every decode or I/O error reading a checkpoint file is a
:class:`CheckpointError` whose one-line message names the file.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model
from torch import nn

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
"""Version of the manifest's layout; a manifest of another version is refused, not guessed at."""
STATE_FILE = "state.json"
TMP_PREFIX = ".tmp-step_"
"""How a checkpoint folder is named while it is written (``.tmp-step_000010`` or ``.tmp-step_000010-<random>``)."""
_STEP_NAME = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, damaged or inconsistent; the message names the file and why."""


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def read_json(path: Path) -> Any:
    """The JSON in ``path``; a missing, unreadable or malformed file is a :class:`CheckpointError`."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({_reason(error)})") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing, truncated or malformed file is a :class:`CheckpointError`."""
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({_reason(error)})") from None


def load_module(module: nn.Module, path: Path) -> None:
    """``safetensors.torch.load_model`` with decode and I/O errors as :class:`CheckpointError`. Keys or shapes
    that do not match stay torch's RuntimeError: that is a config change, not a damaged file."""
    try:
        load_model(module, str(path))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({_reason(error)})") from None


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST)


def write_manifest(folder: Path, step: int) -> None:
    """Seal ``folder``: its step and each file's size and sha256 (relative POSIX paths) in ``manifest.json``."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(folder)}
    payload = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    (folder / MANIFEST).write_text(json.dumps(payload, indent=1, sort_keys=True))


def folder_step(folder: Path) -> int | None:
    """N for a folder named ``step_N``, else None (a checkpoint moved into an artifact under another name)."""
    match = _STEP_NAME.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def verify_checkpoint(folder: Path) -> int:
    """Check ``folder`` against its manifest and return its step; the first problem is a :class:`CheckpointError`
    naming the file: no manifest, a listed file missing, another size or sha256, a ``state.json`` or
    safetensors file that does not decode, or a step that differs between manifest, folder name and
    ``state.json``. Files the manifest does not list are not read by a resume, so they are ignored."""
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST} (it was written by an older version or "
                              "not sealed); it cannot be verified")
    manifest = read_json(manifest_file)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"checkpoint file {manifest_file} is not a format-{MANIFEST_FORMAT} manifest")
    files, step = manifest.get("files"), manifest.get("step")
    if not isinstance(files, dict) or STATE_FILE not in files or not isinstance(step, int):
        raise CheckpointError(f"checkpoint file {manifest_file} lacks its step or its list of files")
    for name, entry in files.items():
        _verify_file(folder / name, entry)
    state = read_json(folder / STATE_FILE)
    steps = {"manifest": step, STATE_FILE: state.get("step") if isinstance(state, dict) else None,
             "folder name": folder_step(folder)}
    if steps["folder name"] is None:
        del steps["folder name"]
    if len(set(steps.values())) != 1:
        said = ", ".join(f"{where} {value}" for where, value in steps.items())
        raise CheckpointError(f"checkpoint file {folder / STATE_FILE} disagrees on the step ({said})")
    return step


def _verify_file(path: Path, entry: Any) -> None:
    if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
        raise CheckpointError(f"checkpoint file {path}: its entry in {MANIFEST} is malformed")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (listed in its {MANIFEST})")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {size} bytes, its {MANIFEST} says {entry['bytes']}")
    if _sha256(path) != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} does not match its sha256 in {MANIFEST} (changed on disk)")
    if path.suffix == ".json":
        read_json(path)
    elif path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt"):
                pass
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"checkpoint file {path} is unreadable ({_reason(error)})") from None


def remove_orphans(root: Path) -> list[Path]:
    """Delete the temporary folders of checkpoint writes that never finished under ``root``; return them.

    One stage writes a checkpoint root at a time (the run's lock; DeepSpeed ranks write one folder together and
    only rank 0 calls this), and a write renames its temporary folder before it returns: a temporary folder seen
    when the root is next written or resumed from is the leftover of a process killed mid-save.
    """
    orphans = sorted(p for p in root.glob(f"{TMP_PREFIX}*") if p.is_dir())
    for orphan in orphans:
        shutil.rmtree(orphan, ignore_errors=True)
    return orphans
