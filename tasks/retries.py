"""When a stage is retried: only for failures that may pass (network, busy storage, a busy tracking store)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.tracking.registry import is_transient_error

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import State


def is_transient(error: BaseException | None) -> bool:
    """OSErrors that may pass (network, busy storage) and transient tracking-store errors; never missing files,
    DataError, configuration errors or bugs, which fail the same way every time."""
    permanent = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    if isinstance(error, OSError):
        return not isinstance(error, permanent)
    return error is not None and is_transient_error(error)


def retry_on_transient_io(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect retry condition of every stage task (see :func:`is_transient`)."""
    return is_transient(state.result(raise_on_failure=False))
