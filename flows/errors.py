"""Exit codes of the `rlhf` command line and the errors that are the user's to fix: what ``flows.cli``,
``flows.commands`` and ``flows.sweep_command`` share (imports nothing heavy, so `rlhf --help` stays fast)."""

from __future__ import annotations

EXIT_FAILED = 1
"""A run or sweep stopped on an error that is not the user's (its log says where; ``rlhf resume`` continues it)."""
EXIT_DATA_ERROR = 2
"""One of :func:`user_errors`: bad input files, unknown or invalid config settings, unknown run ids."""


def user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix (imported only when one is raised, to keep `--help` fast)."""
    from rlhf_core.data import DataError
    from tasks.config import ConfigError
    from tasks.run_store import ArtifactError, StateError
    from tasks.tracking.setup import TrackingUnavailable

    return (DataError, ConfigError, StateError, ArtifactError, TrackingUnavailable)
