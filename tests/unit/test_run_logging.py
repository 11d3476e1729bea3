"""A run's log file holds its own lines: runs of a sweep side by side in one process (threads) do not mix."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from flows.logs import run_logging

log = logging.getLogger("tasks.test_run_logging")


def test_runs_in_threads_keep_their_own_lines_and_share_background_ones(tmp_path: Path) -> None:
    inside, done = threading.Barrier(3), threading.Barrier(3)

    def run(name: str) -> None:
        with run_logging(tmp_path / f"{name}.log"):
            inside.wait()  # both runs are inside their blocks before anyone logs
            log.info("line of %s", name)
            done.wait()
            done.wait()  # the background line below is logged while both blocks are open

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    inside.wait()
    done.wait()
    background = threading.Thread(target=log.info, args=("background line",))  # a thread in no block
    background.start()
    background.join()
    done.wait()
    for thread in threads:
        thread.join()
    a, b = ((tmp_path / f"{name}.log").read_text() for name in ("a", "b"))
    assert "line of a" in a and "line of b" not in a
    assert "line of b" in b and "line of a" not in b
    assert "background line" in a and "background line" in b
