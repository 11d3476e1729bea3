"""Session-wide test isolation: Prefect, MLflow and Hugging Face never touch the home directory or network."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (a CI verdict never depends on luck); a random, longer
# search is one environment variable away: HYPOTHESIS_PROFILE=explore.
settings.register_profile("default", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

_STATE = tempfile.mkdtemp(prefix="rlhf-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_STATE, "prefect"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + os.path.join(_STATE, "mlflow.db"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HOME", os.path.join(_STATE, "hf"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One torch thread for a module: tiny models gain nothing from threads, and on a shared 2-core machine
    spinning threads cost 10x. Stage tests get it automatically (tests/tasks/conftest.py); other modules ask
    with ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
