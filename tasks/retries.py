"""When a stage is retried: only for failures that may pass (network, busy storage, a locked registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import State


def retry_on_transient_io(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect retry condition: retry OSErrors that may pass (network, busy storage), never DataError
    or bugs, which fail the same way every time."""
    error = state.result(raise_on_failure=False)
    permanent = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    return isinstance(error, OSError) and not isinstance(error, permanent)
