"""One MLflow store per stage-test module, restored afterwards (creating the SQLite schema takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
import pytest

from tasks import tracking
from tasks.state import StateDir


@contextmanager
def module_tracking(root: Path) -> Iterator[StateDir]:
    """Point tasks.tracking (and mlflow) at a fresh state directory under ``root`` for the ``with`` body.

    MLFLOW_TRACKING_URI is cleared so the state's own SQLite store is used; tasks.tracking's module state and
    mlflow's tracking URI are put back for the modules that run later.
    """
    previous = mlflow.get_tracking_uri()
    state = StateDir(root / "state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracking, "_state", tracking._state)
        patch.setattr(tracking, "_own_uri", tracking._own_uri)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        tracking.configure_tracking(state)
        yield state
    mlflow.set_tracking_uri(previous)
