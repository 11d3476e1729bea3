"""A sweep's worker processes (``--concurrency`` > 1) report to the Prefect API of the sweep's own process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prefect.client.orchestration import get_client

from flows.sweep import shared_api


def test_worker_processes_inherit_the_api_of_the_sweeps_process(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with get_client(sync_client=True) as client:
        api = str(client.api_url).rstrip("/")
    with shared_api():
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('PREFECT_API_URL'))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == api == os.environ["PREFECT_API_URL"]
    assert "PREFECT_API_URL" not in os.environ  # restored as it was
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    with shared_api():
        pass
    assert os.environ["PREFECT_API_URL"] == "http://elsewhere:4200/api"
