"""The temporary Prefect server's start says in one line why it failed: a server that keeps exiting by itself, or
one that does not answer in time."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flows.prefect_server as prefect_server


def _serving(monkeypatch: pytest.MonkeyPatch, code: str) -> list[subprocess.Popen]:
    """Every server started runs ``code`` instead (with the real one's session and end-with-parent); the list of
    those started."""
    popen, started = subprocess.Popen, []

    def start(args, **kwargs):
        started.append(popen([sys.executable, "-c", code], **kwargs))
        return started[-1]

    monkeypatch.setattr(prefect_server.subprocess, "Popen", start)
    return started


def test_a_server_that_exits_by_itself_is_reported_with_its_status_after_each_port(monkeypatch):
    started = _serving(monkeypatch, "import sys; sys.exit(3)")
    with pytest.raises(RuntimeError, match=rf"exited with status 3 on each of {prefect_server.PORT_TRIES} ports"):
        prefect_server.start_temporary_server(60)
    assert len(started) == prefect_server.PORT_TRIES


def test_a_server_that_does_not_answer_is_stopped_and_the_timeout_named(monkeypatch):
    started = _serving(monkeypatch, "import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match=r"did not answer within 1 s \(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT"):
        prefect_server.start_temporary_server(1)
    assert len(started) == 1 and started[0].returncode == -15  # stopped, not left running
