"""Locks that a killed process left on DeepSpeed's JIT-built ops, cleared before they hang a run.

DeepSpeed builds some ops on first use with torch's ``cpp_extension`` (on CPU: the shared-memory all-reduce
``deepspeed_shm_comm`` at ``init_distributed``; ``cpu_adam`` with optimizer offload). Every load, even of an op
already built, takes a lock file in the op's build folder (``<TORCH_EXTENSIONS_DIR>/py311_cpu/<op>/lock``) and
removes it when done. A process killed in that window (a stage killed mid-start, a machine restarted) leaves
the file behind, and every later load waits for it forever: a resumed run hangs silently at its first step.

The lock is an ``O_EXCL`` file its holder keeps open, so on Linux a lock no process has open is stale and is
removed here (one warning line naming it). Where not every process's open files can be listed (no ``/proc``,
another user's processes), a lock is stale only once it is also older than :data:`STALE_AFTER_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

log = logging.getLogger(__name__)

DEEPSPEED_JIT_OPS = ("deepspeed_shm_comm", "cpu_adam")
"""Build-folder names of the DeepSpeed ops our training paths load on CPU."""
STALE_AFTER_SECONDS = 600.0
"""Without ``/proc``: a lock this old is stale (building one of these ops takes under a minute)."""


def extension_root() -> Path:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR``, else its default cache folder."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def clear_stale_locks(ops: Iterable[str] = DEEPSPEED_JIT_OPS, root: Path | None = None) -> list[Path]:
    """Remove the build locks of ``ops`` that no live process holds; return the removed paths."""
    root = extension_root() if root is None else root
    locks = [lock for op in ops for lock in sorted(root.glob(f"*/{op}/lock"))]
    if not locks:
        return []
    held, complete = _open_files()
    removed = []
    for lock in locks:
        try:
            before = lock.stat()
        except FileNotFoundError:
            continue  # released meanwhile
        old = time.time() - before.st_mtime > STALE_AFTER_SECONDS
        if lock.resolve() in held or not (complete or old):
            continue
        try:
            if lock.stat().st_ino != before.st_ino:
                continue  # released and taken again by a live process meanwhile
            lock.unlink()
        except FileNotFoundError:
            continue
        log.warning("removed %s, a build lock left by a killed process (every DeepSpeed start would wait on it)",
                    lock)
        removed.append(lock)
    return removed


def _open_files() -> tuple[set[Path], bool]:
    """The files processes on this machine have open, and whether that is every process's (False without
    /proc or where another user's processes cannot be read)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return set(), False
    files: set[Path] = set()
    complete = True
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            entries = list(fd_dir.iterdir())
        except PermissionError:
            complete = False
            continue
        except OSError:  # the process ended meanwhile
            continue
        for entry in entries:
            try:
                target = os.readlink(entry)
            except OSError:
                continue
            if target.startswith("/"):
                files.add(Path(target))
    return files, complete
