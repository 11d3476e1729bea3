"""A full disk still records how a run ended: the state folder holds back a reserve that is freed for the record.

On a real 4 MiB tmpfs (needs root to mount; skipped otherwise): the disk is filled to ENOSPC, then the run is marked
failed. Without the reserve the same write fails, so the test shows what the reserve is for.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.run_store import RESERVE_BYTES, RunStore


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as err:
            assert err.errno == errno.ENOSPC


def _running_run(root: Path) -> tuple[RunStore, str]:
    store = RunStore(root).ensure()
    record = store.create_run("full-disk", "name: full-disk\n")
    return store, record.run_id


def test_a_full_disk_still_records_that_the_run_failed(small_disk: Path) -> None:
    store, run_id = _running_run(small_disk / "state")
    assert store.layout.reserve.stat().st_size == RESERVE_BYTES
    with store.hold(run_id, "test"):
        _fill(small_disk)  # a stage fills the disk; the run fails and lets go of it
    # what Prefect's failure hook does (flows/pipeline.py): take the run's lock and mark it
    assert store.end_run(run_id, "failed", "OSError: [Errno 28] No space left on device")
    record = store.load_run(run_id)
    assert (record.status, record.error) == ("failed", "OSError: [Errno 28] No space left on device")
    assert not store.layout.reserve.exists()
    (small_disk / "filler").unlink()
    store.ensure()  # space again: the reserve is held back again
    assert store.layout.reserve.stat().st_size == RESERVE_BYTES


def test_without_the_reserve_the_record_could_not_be_written(small_disk: Path) -> None:
    store, run_id = _running_run(small_disk / "state")
    store.layout.reserve.unlink()
    with store.hold(run_id, "test"):
        _fill(small_disk)
    with pytest.raises(OSError) as info:
        store.end_run(run_id, "failed", "disk full")
    assert info.value.errno == errno.ENOSPC
    assert store.load_run(run_id).status == "running"
