"""Stage tests: keep Prefect quiet, offline and away from the user's ~/.prefect."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

# Set before any test module imports prefect; Prefect reads these settings lazily from the environment.
os.environ["PREFECT_HOME"] = _home = tempfile.mkdtemp(prefix="prefect-home-")
atexit.register(shutil.rmtree, _home, ignore_errors=True)
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared 2-core machine spinning threads cost 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
