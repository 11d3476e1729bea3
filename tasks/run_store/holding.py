"""One writer per run and per sweep: their locks, and the errors that say who holds them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.run_store.locks import FileLock, Holder, LockBusy, holder_if_alive


class StateError(LookupError):
    """A run that is missing, unreadable or busy; the message names it and what to do."""


class RunLockedError(StateError):
    """Another live process holds the run (one writer per run)."""


@contextmanager
def sole_writer(lock_path: Path, purpose: str, what: str) -> Iterator[None]:
    """Hold ``lock_path`` (with a heartbeat) while inside; RunLockedError naming ``what`` ('run X') and the holder."""
    lock = FileLock(lock_path, purpose)
    try:
        lock.acquire()
    except LockBusy as busy:
        raise locked(what, busy.holder) from None
    lock.start_heartbeat()
    try:
        yield
    finally:
        lock.release()


def refuse_if_held(lock_path: Path, what: str) -> None:
    """RunLockedError naming the live holder of ``lock_path``, if there is one."""
    holder = holder_if_alive(lock_path)
    if holder is not None:
        raise locked(what, holder)


def locked(what: str, holder: Holder | None) -> RunLockedError:
    """``what`` ('run X', 'sweep Y') is held by a live process."""
    who = holder.describe() if holder else "another process"
    return RunLockedError(f"{what} is in use by {who}; wait for it to end, or stop that process first (a killed "
                          "holder frees it at once)")
