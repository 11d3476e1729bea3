"""Where MLflow writes: the tracking URI, the local store inside the state folder, experiments."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.tracking._tracking_service import utils as tracking_service_utils

if TYPE_CHECKING:
    from tasks.config import PipelineConfig
    from tasks.run_store import RunStore

log = logging.getLogger(__name__)

#: Tracking stores that decide artifact locations themselves; every other store gets ours.
_SERVER_SCHEMES = frozenset({"http", "https", "databricks", "databricks-uc"})
#: Columns of MLflow's SQLite store that hold absolute artifact locations (rebased when the state folder moves).
_LOCATION_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"), ("model_versions", "source"),
                     ("model_versions", "storage_location"), ("logged_models", "artifact_location"))

#: MLflow 3's UI opens an experiment without this tag on its GenAI (traces) view; ours are training runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")

_store: RunStore | None = None
#: The URI configure_tracking chose itself (not from the environment), see there.
_own_uri: str | None = None


class TrackingUnavailable(ConnectionError):
    """The tracking server cannot be reached (at start), or did not take queued metrics in time."""


def configure_tracking(store: RunStore, uri: str | None = None) -> str:
    """Point MLflow at MLFLOW_TRACKING_URI if set, else ``uri``, else SQLite in the state folder; returns the URI.

    The local store is created under the store's init lock (two runs starting on a fresh folder), and when the
    state folder was moved or copied its recorded artifact locations are rebased onto the new place.
    """
    global _store, _own_uri
    _store = store
    # MLflow asks an outside telemetry host on every run unless told not to; the user may turn it back on.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI for subprocesses, so the variable may hold our own
    # earlier choice; only a value we did not set is the user's, and only the user's wins.
    env = os.environ.get("MLFLOW_TRACKING_URI")
    from_user = env if env and env != _own_uri else None
    local = f"sqlite:///{store.layout.mlflow_db}"
    resolved = from_user or uri or local
    _own_uri = None if from_user else resolved
    check_server(resolved)
    mlflow.set_tracking_uri(resolved)
    with store.initializing():
        if resolved == local:
            if store.moved_from and store.layout.mlflow_db.is_file():
                rebase_local_store(store.layout.mlflow_db, store.moved_from, str(store.root))
            MlflowClient().search_experiments(max_results=1)  # creates the tables, once, under the lock
        if store.moved_from:
            store.settle_move()
    return resolved


HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
"""Bounds on one request to a tracking server (each may be set in the environment): 3 retries 1, 2, 4 s apart and
30 s per try, instead of MLflow's 7 retries up to 64 s apart and 120 s per try (a down server held a run 499 s)."""
REACHABLE_TIMEOUT_SECONDS = 5.0


def check_server(uri: str | None) -> None:
    """For a tracking server (http/https; ``uri`` None = MLFLOW_TRACKING_URI, if set): bound each request
    (:data:`HTTP_LIMITS`) and fail in seconds, in one line, when nothing answers (:func:`check_reachable`)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or urlparse(uri).scheme not in ("http", "https"):
        return
    for name, value in HTTP_LIMITS.items():  # MLflow's own defaults retry one request for minutes
        os.environ.setdefault(name, value)
    check_reachable(uri)


def check_reachable(uri: str, timeout: float = REACHABLE_TIMEOUT_SECONDS) -> None:
    """TrackingUnavailable, in one line and within ``timeout`` seconds, when nothing answers at the server's
    address (any HTTP answer, an error status included, counts as reachable: the server then says what is wrong)."""
    import requests

    clean = without_credentials(uri)[0]
    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout)
    except requests.RequestException as err:
        reason = type(err).__name__
        raise TrackingUnavailable(f"MLflow tracking server {clean} is not reachable ({reason} within {timeout:.0f} s); "
                                  "start it, or unset MLFLOW_TRACKING_URI / tracking.tracking_uri to track into the "
                                  "state folder") from None


def without_credentials(uri: str) -> tuple[str, tuple[str, str] | None]:
    """``uri`` without a ``user:password@`` part, and that (user, password) (None when it has none)."""
    parsed = urlparse(uri)
    if parsed.username is None and parsed.password is None:
        return uri, None
    host = parsed.netloc.rpartition("@")[2]
    return parsed._replace(netloc=host).geturl(), (unquote(parsed.username or ""), unquote(parsed.password or ""))


def keep_credentials_out(config: PipelineConfig) -> PipelineConfig:
    """The config to record: a user and password in ``tracking.tracking_uri`` move into this process's
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (MLflow's basic auth, inherited by stage subprocesses),
    so the run's config.yaml, its MLflow params and its logs never hold them. A later ``rlhf resume`` reads them
    from those variables."""
    uri = config.tracking.tracking_uri
    clean, credentials = without_credentials(uri) if uri else (uri, None)
    if credentials is None:
        return config
    if urlparse(uri).scheme not in ("http", "https"):  # a database store reads them from the URI only
        from tasks.typed_yaml import ConfigError

        raise ConfigError("tracking.tracking_uri holds a password, which would be recorded with the run: set the URI "
                          "in MLFLOW_TRACKING_URI instead (it wins over tracking.tracking_uri and is never recorded)")
    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = credentials
    log.warning("tracking.tracking_uri held a user and password: they are kept out of the recorded config; "
                "`rlhf resume` in another shell needs MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    return dataclasses.replace(config, tracking=dataclasses.replace(config.tracking, tracking_uri=clean))


def rebase_local_store(db: Path, old_root: str, new_root: str) -> int:
    """Rewrite the artifact locations of a moved state folder's SQLite store; returns the rows changed."""
    changed = 0
    with sqlite3.connect(db) as connection:
        tables = {row[0] for row in connection.execute("select name from sqlite_master where type='table'")}
        for table, column in _LOCATION_COLUMNS:
            if table not in tables:
                continue
            for old, new in ((Path(old_root).as_uri(), Path(new_root).as_uri()), (old_root, new_root)):
                cursor = connection.execute(
                    f"update {table} set {column} = ? || substr({column}, ?) where {column} like ? escape '\\'",
                    (new, len(old) + 1, old.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "/%"))
                changed += cursor.rowcount
    # MLflow caches each run's artifact location in this process; after a rebase that cache would still write to
    # the old place (it is private, hence the guard).
    cache = getattr(tracking_service_utils, "_artifact_repos_cache", None)
    if cache is not None:
        cache.clear()
    log.info("state folder moved from %s: rebased %d MLflow artifact locations", old_root, changed)
    return changed


def configured_store() -> RunStore:
    if _store is None:
        raise RuntimeError("MLflow tracking is not configured; call tasks.tracking.configure_tracking(store) first")
    return _store


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def ensure_experiment(name: str) -> str:
    """Id of experiment ``name``, created (artifacts under the state folder for local stores) or restored."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        if EXPERIMENT_KIND[0] not in experiment.tags:  # made by an older version, or by hand
            client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
        return experiment.experiment_id
    location = None
    if urlparse(mlflow.get_tracking_uri()).scheme not in _SERVER_SCHEMES:
        # A local store would otherwise put artifacts in ./mlruns of whatever directory we run in.
        location = (configured_store().layout.mlartifacts / slug(name)).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":  # another process created it first
            raise
        return client.get_experiment_by_name(name).experiment_id
