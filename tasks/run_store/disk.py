"""Writes of the state folder's small records: atomic, and still possible once the disk is full (a reserve the
store holds back is freed for them)."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

RESERVE_BYTES = 1 << 20
"""Space the state folder holds back for run records on a full disk (they are a few KiB)."""


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (the one atomic write of the project)."""
    from tasks.io import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


class DiskReserve:
    """:data:`RESERVE_BYTES` held back at ``path`` (a file in the state folder ``root``) for the records a run writes
    on a full disk."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root

    def with_room(self, write: Callable[[], None]) -> None:
        """``write()``; on a full disk once more after freeing the reserve (a record of how the run ended)."""
        try:
            write()
        except OSError as err:
            if err.errno != errno.ENOSPC or not self.release():
                raise
            write()

    def hold(self) -> None:
        """Keep :data:`RESERVE_BYTES` allocated (when the disk has them)."""
        if self.path.is_file() and self.path.stat().st_size >= RESERVE_BYTES:
            return
        try:
            with open(self.path, "wb") as handle:
                os.posix_fallocate(handle.fileno(), 0, RESERVE_BYTES)
        except (OSError, AttributeError):  # a full disk, or no posix_fallocate (not Linux): go on without
            self.path.unlink(missing_ok=True)

    def release(self) -> bool:
        """Free the reserve on a full disk; True when there was one to free."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        log.warning("the disk of %s is full: freed its %d KiB reserve to record the run's status; free space "
                    "before `rlhf resume`", self.root, RESERVE_BYTES // 1024)
        return True
