"""Stage tests: keep Prefect quiet, offline and away from the user's ~/.prefect."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Set before any test module imports prefect; Prefect reads these settings lazily from the environment.
os.environ["PREFECT_HOME"] = _home = tempfile.mkdtemp(prefix="prefect-home-")
atexit.register(shutil.rmtree, _home, ignore_errors=True)
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread: None) -> None:
    """Every stage test module runs with one torch thread (tests/conftest.py's ``single_thread``)."""
