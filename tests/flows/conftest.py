"""One Prefect test harness for every flow test, and a helper that starts a pipeline run on the tiny preset."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from tasks.config import load_config
from tasks.run_store import RunRecord, RunStore
from tasks.typed_yaml import dump_config_text


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh MLflow store (a sqlite registry) for the test: its tracking URI."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def new_tiny_run(state_dir: Path, *overrides: str) -> tuple[RunStore, RunRecord]:
    """A run with the tiny preset's config recorded in its folder (what `rlhf run` does before the flow)."""
    config = load_config(None, "tiny", [f"state_dir={state_dir}", *overrides])
    store = RunStore(config.state_dir).ensure()
    return store, store.create_run(config.name, dump_config_text(config), preset="tiny")
