"""Atomic, pickle-free PPO checkpoints: weights and optimizer tensors in safetensors, the rest in JSON.

Layout of ``<root>/step_000010/``: ``policy.safetensors``, ``value.safetensors``, optional
``reference.safetensors``, ``optimizer.safetensors`` + ``optimizer.json``, ``rng.safetensors``,
``state.json`` and ``manifest.json`` (sizes and sha256 of the others: ``checkpoint_integrity``). ``<root>/latest``
names the newest complete checkpoint; a directory only gets its final name after every file in it is written,
so a run killed mid-save leaves the previous checkpoint intact. A resume (:func:`resume_checkpoint`) verifies the
checkpoint against its manifest and falls back to an earlier one when it is damaged.
A DeepSpeed run (``rlhf_core.distributed.zero``) writes the same weights and JSON files but keeps its optimizer
and schedule in ``deepspeed/`` (DeepSpeed's own per-process shards, pickled) instead of ``optimizer.*``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file, save_model
from torch import nn

from rlhf_core.training.checkpoint_integrity import (
    TMP_PREFIX,
    CheckpointError,
    folder_step,
    load_module,
    read_json,
    read_tensors,
    remove_orphans,
    verify_checkpoint,
    write_manifest,
)

log = logging.getLogger(__name__)

LATEST = "latest"
DEEPSPEED_DIR = "deepspeed"
"""Sub-folder of a checkpoint written under DeepSpeed: each engine's ZeRO shards (optimizer, schedule)."""


def flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (``state/<param>/<name>``) and JSON-able metadata."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state_dict["state"].items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{param_id}/{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten_optimizer`."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, param_id, name = key.split("/", 2)
        state.setdefault(int(param_id), {})[name] = value
    for param_id, values in meta["scalars"].items():
        state.setdefault(int(param_id), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> list[Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _restore_global_rng(state: dict[str, Any], rng_tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy_rng"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng_tensors["torch_global"])


class TrainableView(nn.Module):
    """The trainable parameters of a module (the same tensors, not copies) as a module of their own.

    What a checkpoint stores of a model whose frozen weights are the run's starting point (a LoRA adapter over
    the SFT model): the adapter, not the base. Loading into the view writes into the live parameters.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for name, param in module.named_parameters():
            if param.requires_grad:
                self.register_parameter(name.replace(".", "/"), param)


def trainable_view(module: nn.Module) -> nn.Module:
    """``module`` itself when every parameter trains (full fine-tuning), else its :class:`TrainableView`."""
    if all(p.requires_grad for p in module.parameters()):
        return module
    return TrainableView(module)


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=1, sort_keys=True))


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``<root>/step_<step>`` atomically and point ``latest`` at it; keep the newest ``keep``.

    ``modules`` maps a file stem (``policy``, ``value``, ``reference``) to a module; ``state`` is any
    JSON-serialisable dict (KL controller, sampler cursor, scheduler, history ...).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step:06d}-", dir=root))
    for stem, module in modules.items():
        save_model(module, str(tmp / f"{stem}.safetensors"))
    opt_tensors, opt_meta = flatten_optimizer(optimizer.state_dict())
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    _write_json(tmp / "optimizer.json", opt_meta)
    write_run_state(tmp, step, generator, state)
    return publish(root, tmp, final.name, keep)


def write_run_state(folder: Path, step: int, generator: torch.Generator, state: dict[str, Any]) -> None:
    """``rng.safetensors`` (the run's generator, torch's global RNG) and ``state.json`` (``state``, step, RNGs)."""
    save_file({"generator": generator.get_state(), "torch_global": torch.get_rng_state()}, str(folder / "rng.safetensors"))
    _write_json(folder / "state.json", {**state, "step": step, "python_rng": _python_rng_state(), "numpy_rng": _numpy_rng_state()})


def publish(root: Path, tmp: Path, name: str, keep: int) -> Path:
    """Seal the complete folder ``tmp`` with its manifest, move it to ``root/name`` (``step_<N>``), point
    ``latest`` at it, keep the newest ``keep`` and remove temporary folders that killed writes left behind."""
    final = root / name
    step = folder_step(final)
    if step is None:
        raise ValueError(f"a checkpoint folder is named step_<N>, not {name!r}")
    write_manifest(tmp, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _point_latest(root, final.name)
    _prune(root, keep, step)
    remove_orphans(root)
    return final


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as handle:
        handle.write(name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / LATEST)


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """``(N, root/step_N)`` for every checkpoint folder, oldest first."""
    found = ((folder_step(p), p) for p in root.glob("step_*") if p.is_dir())
    return sorted((step, p) for step, p in found if step is not None)


def _prune(root: Path, keep: int, newest: int) -> None:
    """Keep the ``keep`` newest checkpoints up to step ``newest``. Later ones are from a run that went back past
    them (a damaged checkpoint a resume skipped): the run writes those steps again, so they go too."""
    steps = _step_folders(root)
    older = [p for step, p in steps if step <= newest]
    for old in older[: max(0, len(older) - keep)] + [p for step, p in steps if step > newest]:
        shutil.rmtree(old)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or None."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text(errors="replace").strip()
    return path if path.is_dir() else None


def resume_checkpoint(root: str | os.PathLike[str], clean: bool = True) -> Path | None:
    """The checkpoint a run resumes from: the newest one under ``root`` that verifies against its manifest.

    Starts at the one ``latest`` names (at the newest ``step_*`` folder when ``latest`` is missing) and goes back
    through earlier ones; each one skipped costs a warning naming the file and the reason. None when there is
    no usable checkpoint (also said in a warning when some were skipped). ``clean``: first remove temporary
    folders of killed writes (only one process of a data-parallel run may).
    """
    root = Path(root)
    if clean and root.is_dir():
        remove_orphans(root)
    latest = latest_checkpoint(root)
    ceiling = folder_step(latest) if latest is not None else None
    candidates = [p for step, p in reversed(_step_folders(root)) if ceiling is None or step <= ceiling]
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as error:
            log.warning("skipping checkpoint %s: %s", candidate.name, error)
            continue
        return candidate
    if candidates:
        log.warning("no usable checkpoint in %s (%d skipped): the run starts as if it had none", root, len(candidates))
    return None


def load_checkpoint(
    path: str | os.PathLike[str],
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
) -> dict[str, Any]:
    """Restore weights, optimizer, generator and global RNGs in place; return the JSON state."""
    path = Path(path)
    for stem, module in modules.items():
        file = path / f"{stem}.safetensors"
        if not file.exists():
            raise FileNotFoundError(f"checkpoint {path} has no {file.name}; it was saved with other model roles")
        load_module(module, file)
    if not (path / "optimizer.json").exists() and (path / DEEPSPEED_DIR).is_dir():
        raise FileNotFoundError(
            f"checkpoint {path} was written by a DeepSpeed run (its optimizer state is in {DEEPSPEED_DIR}/, sharded "
            "per process): resume it with the same distributed settings, or delete the checkpoints to start over"
        )
    meta = read_json(path / "optimizer.json")
    optimizer.load_state_dict(unflatten_optimizer(read_tensors(path / "optimizer.safetensors"), meta))
    return read_run_state(path, generator)


def load_weights(path: str | os.PathLike[str], modules: dict[str, nn.Module]) -> dict[str, Any]:
    """Only the weights of a checkpoint (whichever strategy wrote it) into ``modules``; return its JSON state."""
    path = Path(path)
    for stem, module in modules.items():
        load_module(module, path / f"{stem}.safetensors")
    return read_json(path / "state.json")


def read_run_state(path: Path, generator: torch.Generator) -> dict[str, Any]:
    """Restore the generator and the global RNGs written by :func:`write_run_state`; return the JSON state."""
    rng = read_tensors(path / "rng.safetensors")
    state = read_json(path / "state.json")
    generator.set_state(rng["generator"])
    _restore_global_rng(state, rng)
    return state
