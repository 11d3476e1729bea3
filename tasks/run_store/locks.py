"""Advisory file locks (``flock``) that say who holds them.

The kernel releases an flock when its holder dies, even by SIGKILL, so "can I take the lock?" is also "is the
holder still alive?" on one machine. The holder writes who it is (pid, host, what it does) into the lock file and
touches the file's mtime as a heartbeat; on a shared disk seen from several machines, where flock may not reach
across hosts, a heartbeat older than ``STALE_AFTER`` seconds means the holder is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

HEARTBEAT_SECONDS = 30.0
"""How often a holder touches its lock file."""
STALE_AFTER = 5 * HEARTBEAT_SECONDS
"""A holder on another host whose heartbeat is older than this is taken to be dead."""
PROBE_RETRIES = 5


def now_iso() -> str:
    """UTC now, ISO 8601 with microseconds (sortable as text)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class Holder:
    """Who holds a lock."""

    pid: int
    host: str
    purpose: str
    since: str

    def describe(self) -> str:
        """'pid 123 on host-a since 2026-...: rlhf resume' for one-line errors."""
        return f"pid {self.pid} on {self.host} since {self.since}: {self.purpose}"


class LockBusy(RuntimeError):
    """The lock is held by a live holder."""

    def __init__(self, path: Path, holder: Holder | None) -> None:
        self.path, self.holder = path, holder
        who = holder.describe() if holder else "an unknown process"
        super().__init__(f"{path} is held by {who}")


class FileLock:
    """One exclusive flock on ``path`` with holder information and an optional heartbeat thread."""

    def __init__(self, path: str | os.PathLike[str], purpose: str = "") -> None:
        self.path, self.purpose = Path(path), purpose
        self._fd: int | None = None
        self._beat: threading.Event | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, blocking: bool = False) -> FileLock:
        """Take the lock (waiting for it when ``blocking``); LockBusy names the live holder otherwise."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this object")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd, blocking)
        except BlockingIOError:
            os.close(fd)
            raise LockBusy(self.path, read_holder(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        holder = Holder(os.getpid(), socket.gethostname(), self.purpose, now_iso())
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(holder)).encode(), 0)
        return self

    def release(self) -> None:
        """Stop the heartbeat, clear the holder information and unlock (idempotent)."""
        self.stop_heartbeat()
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def start_heartbeat(self, every: float = HEARTBEAT_SECONDS) -> None:
        """Touch the lock file every ``every`` seconds from a daemon thread until released."""
        if self._beat is not None:
            return
        stop = self._beat = threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                try:
                    os.utime(self.path)
                except OSError:  # a full or vanished disk must not kill the run from a side thread
                    pass

        threading.Thread(target=beat, name=f"heartbeat:{self.path.name}", daemon=True).start()

    def stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.set()
            self._beat = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(fd: int, blocking: bool) -> None:
    """flock LOCK_EX; without blocking, a few quick retries first, since a liveness probe
    (:func:`holder_if_alive`) holds a shared lock for a moment."""
    if blocking:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    for attempt in range(PROBE_RETRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == PROBE_RETRIES - 1:
                raise
            time.sleep(0.02)


def read_holder(path: str | os.PathLike[str]) -> Holder | None:
    """The holder information in a lock file, or None when there is none (released, or never written)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8") or "null")
        return Holder(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def holder_if_alive(path: str | os.PathLike[str]) -> Holder | None:
    """The live holder of the lock at ``path``, or None when nobody (alive) holds it.

    Free flock -> nobody. Held flock -> its holder, except that a holder on another host whose heartbeat stopped
    more than ``STALE_AFTER`` seconds ago counts as dead (flock over a network disk is not trustworthy).
    """
    path = Path(path)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(path) or Holder(-1, "?", "unknown", "?")
            stale = time.time() - path.stat().st_mtime > STALE_AFTER
            return None if stale and holder.host != socket.gethostname() else holder
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
