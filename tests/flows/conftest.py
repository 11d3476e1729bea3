"""One Prefect test harness for every flow test, and a helper that starts a pipeline run on the tiny preset."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from tasks.config import load_config
from tasks.state import RunRecord, StateDir
from tasks.typed_yaml import dump_config


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def new_tiny_run(state_dir: Path, *overrides: str) -> tuple[StateDir, RunRecord]:
    """A run record with the tiny preset's config recorded in its folder (what `rlhf run` does)."""
    config = load_config(None, "tiny", [f"state_dir={state_dir}", *overrides])
    state = StateDir(config.state_dir).ensure()
    record = state.new_run(config.name)
    record.config_path = dump_config(config, state.run_dir(record.run_id) / "config.yaml")
    state.save_run(record)
    return state, record
