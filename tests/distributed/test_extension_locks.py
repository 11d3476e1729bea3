"""A build lock that a killed process left on a DeepSpeed op is removed before it hangs the next start.

The holder is a real process taking torch's own FileBaton, as ``cpp_extension`` does while it loads an op:
while it lives its lock stays; once it is SIGKILLed the lock is stale and is removed, and the next FileBaton
acquires at once (before this fix, every DeepSpeed start on the machine waited on it forever).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from torch.utils.file_baton import FileBaton

from rlhf_core.distributed.extension_locks import clear_stale_locks, extension_root

HOLDER = """
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def _hold(lock) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_lock_a_live_process_holds_is_kept_and_a_killed_ones_is_removed(tmp_path, caplog):
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    holder = _hold(lock)
    try:
        assert clear_stale_locks(root=tmp_path) == []
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert lock.exists()  # what a killed load leaves behind
    with caplog.at_level(logging.WARNING, logger="rlhf_core.distributed.extension_locks"):
        assert clear_stale_locks(root=tmp_path) == [lock]
    assert not lock.exists()
    assert f"removed {lock}, a build lock left by a killed process" in caplog.text
    baton = FileBaton(str(lock))
    assert baton.try_acquire()  # the next load goes ahead instead of waiting forever
    baton.release()


def test_only_the_named_ops_locks_are_touched(tmp_path):
    ours = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    other = tmp_path / "py311_cpu" / "someone_elses_op" / "lock"
    for lock in (ours, other):
        lock.parent.mkdir(parents=True)
        lock.touch()
    assert clear_stale_locks(root=tmp_path) == [ours]
    assert other.exists()


def test_without_a_process_table_only_an_old_lock_is_stale(tmp_path, monkeypatch):
    import rlhf_core.distributed.extension_locks as locks

    monkeypatch.setattr(locks, "_open_files", lambda: (set(), False))
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert clear_stale_locks(root=tmp_path) == []  # young: maybe a load on another machine sharing the folder
    old = time.time() - locks.STALE_AFTER_SECONDS - 1
    os.utime(lock, (old, old))
    assert clear_stale_locks(root=tmp_path) == [lock]


def test_the_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension_root() == tmp_path
