"""MLflow helpers: one parent run per pipeline run, one nested run per stage, models registered with aliases.

Call ``configure_tracking(state)`` once per process first. Without MLFLOW_TRACKING_URI, tracking goes to a
SQLite store inside the state dir and artifacts to ``state/mlartifacts``; pointing the variable at a server
changes nothing else. Every helper takes an explicit ``run_id`` or uses the active run of the calling thread
(MLflow's active run is thread-local, and Prefect runs tasks in worker threads, hence ``parent_run_id``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from tasks.state import StateDir

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

STAGE_TAG = "stage"
KIND_TAG = "rlhf.kind"
TRUNCATED = "...[truncated]"
#: Tracking stores that decide artifact locations themselves; every other store gets ours.
_SERVER_SCHEMES = frozenset({"http", "https", "databricks", "databricks-uc"})
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")

_state: StateDir | None = None
#: The URI configure_tracking chose itself (not from the environment), see there.
_own_uri: str | None = None


@dataclass(frozen=True)
class ModelRef:
    """A registered model version."""

    name: str
    """Registered model name."""
    version: int
    """Version number (1, 2, ...)."""
    uri: str
    """``models:/name/version``."""


def configure_tracking(state: StateDir, uri: str | None = None) -> str:
    """Point MLflow at MLFLOW_TRACKING_URI if set, else ``uri``, else SQLite in ``state``; returns the URI."""
    global _state, _own_uri
    state.ensure()
    _state = state
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI for subprocesses, so the variable may hold our own
    # earlier choice; only a value we did not set is the user's, and only the user's wins.
    env = os.environ.get("MLFLOW_TRACKING_URI")
    from_user = env if env and env != _own_uri else None
    resolved = from_user or uri or state.mlflow_uri
    _own_uri = None if from_user else resolved
    mlflow.set_tracking_uri(resolved)
    return resolved


def _configured_state() -> StateDir:
    if _state is None:
        raise RuntimeError("MLflow tracking is not configured; call tasks.tracking.configure_tracking(state) first")
    return _state


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def ensure_experiment(name: str) -> str:
    """Id of experiment ``name``, created (artifacts under the state dir for local stores) or restored if needed."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    location = None
    if urlparse(mlflow.get_tracking_uri()).scheme not in _SERVER_SCHEMES:
        # A local store would otherwise put artifacts in ./mlruns of whatever directory we run in.
        location = (_configured_state().mlartifacts / _slug(name)).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":  # another process created it first
            raise
        return client.get_experiment_by_name(name).experiment_id


@contextmanager
def pipeline_run(experiment: str, run_name: str, params: Mapping[str, object] | None = None,
                 tags: Mapping[str, str] | None = None, run_id: str | None = None) -> Iterator[mlflow.ActiveRun]:
    """The parent run of one pipeline run; pass ``run_id`` to resume it. Ends FINISHED, or FAILED on error."""
    all_tags = {KIND_TAG: "pipeline", **(tags or {})}
    if run_id is None:
        started = mlflow.start_run(experiment_id=ensure_experiment(experiment), run_name=run_name, tags=all_tags)
    else:
        started = mlflow.start_run(run_id=run_id, tags=all_tags)
    with started as run:
        if params:
            log_params_flat(params, run.info.run_id)
        yield run


@contextmanager
def stage_run(stage_name: str, parent_run_id: str, params: Mapping[str, object] | None = None,
              tags: Mapping[str, str] | None = None, run_id: str | None = None) -> Iterator[mlflow.ActiveRun]:
    """A nested run for one stage under ``parent_run_id`` (tags mlflow.parentRunId and stage=<name>).

    Pass ``run_id`` to resume a stage run (e.g. a PPO stage restarted from its checkpoint).
    """
    all_tags = {STAGE_TAG: stage_name, KIND_TAG: "stage", **(tags or {})}
    if run_id is None:
        experiment_id = MlflowClient().get_run(parent_run_id).info.experiment_id
        started = mlflow.start_run(experiment_id=experiment_id, run_name=stage_name, nested=True,
                                   parent_run_id=parent_run_id, tags=all_tags)
    else:
        started = mlflow.start_run(run_id=run_id, nested=True, tags=all_tags)
    with started as run:
        if params:
            log_params_flat(params, run.info.run_id)
        yield run


def _run_id(run_id: str | None) -> str:
    if run_id is not None:
        return run_id
    active = mlflow.active_run()
    if active is None:
        raise RuntimeError("no active MLflow run in this thread; use pipeline_run/stage_run or pass run_id")
    return active.info.run_id


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def log_metrics(metrics: Mapping[str, float], step: int | None = None, run_id: str | None = None) -> None:
    """Log metrics (e.g. ``{'ppo/policy/clipfrac': 0.1}``) at ``step`` to ``run_id`` or the active run."""
    target, now = _run_id(run_id), int(time.time() * 1000)
    entries = [Metric(key, float(value), now, step or 0) for key, value in metrics.items()]
    client = MlflowClient()
    for chunk in _chunks(entries, MAX_METRICS_PER_BATCH):
        client.log_batch(target, metrics=list(chunk))


def _param_value(key: str, value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        log.warning("param %s is %d characters; MLflow keeps %d, so it is truncated", key, len(text),
                    MAX_PARAM_VAL_LENGTH)
        text = text[: MAX_PARAM_VAL_LENGTH - len(TRUNCATED)] + TRUNCATED
    return text


def log_params_flat(params: Mapping[str, object], run_id: str | None = None) -> dict[str, str]:
    """Log flat params in batches of 100, values cut to MLflow's 6000 characters; returns what was sent.

    MLflow params are write-once: keys already logged with the same value are skipped (so a resumed run can
    log its config again); a different value raises ValueError naming the keys.
    """
    target = _run_id(run_id)
    client = MlflowClient()
    existing = client.get_run(target).data.params
    values = {key: _param_value(key, value) for key, value in params.items()}
    changed = {k: (existing[k], v) for k, v in values.items() if k in existing and existing[k] != v}
    if changed:
        shown = "; ".join(f"{k}: logged {old!r}, now {new!r}" for k, (old, new) in sorted(changed.items())[:10])
        raise ValueError(f"MLflow run {target} already has different values for params ({shown}); params are "
                         "write-once: start a new run, or log the changing value as a metric or tag")
    fresh = {k: v for k, v in values.items() if k not in existing}
    for chunk in _chunks(list(fresh.items()), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(target, params=[Param(k, v) for k, v in chunk])
    return fresh


def log_figure(fig: Figure, artifact_path: str, run_id: str | None = None) -> None:
    """Save a matplotlib figure as an artifact file (e.g. 'plots/reward.png')."""
    MlflowClient().log_figure(_run_id(run_id), fig, artifact_path)


def log_file(path: str | os.PathLike[str], artifact_path: str | None = None, run_id: str | None = None) -> None:
    """Copy a local file (or folder) into the run's artifacts under ``artifact_path``."""
    local = Path(path)
    client = MlflowClient()
    if local.is_dir():
        client.log_artifacts(_run_id(run_id), str(local), artifact_path)
    else:
        client.log_artifact(_run_id(run_id), str(local), artifact_path)


def _free_artifact_path(client: MlflowClient, run_id: str, base: str) -> str:
    candidate, n = base, 1
    while client.list_artifacts(run_id, candidate):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def register_model_dir(local_dir: str | os.PathLike[str], name: str, run_id: str,
                       aliases: Sequence[str] = ("candidate",), artifact_path: str | None = None) -> ModelRef:
    """Log a saved model folder as artifacts of ``run_id`` and register it as a new version of ``name``.

    ``artifact_path`` defaults to ``models/<name>`` (``-2``, ``-3``... when the run already holds one), since
    overwriting a registered version's files would silently change that version. Aliases move to it.
    """
    local = Path(local_dir)
    if not local.is_dir():
        raise FileNotFoundError(f"cannot register {local}: not a folder (save the model with save_pretrained first)")
    client = MlflowClient()
    if artifact_path is None:
        artifact_path = _free_artifact_path(client, run_id, f"models/{_slug(name)}")
    elif client.list_artifacts(run_id, artifact_path):
        raise ValueError(f"run {run_id} already has artifacts at {artifact_path!r}; registering there would change "
                         "an earlier version's files. Pick another artifact_path or leave it None")
    client.log_artifacts(run_id, str(local), artifact_path)
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = int(client.create_model_version(name, source=source, run_id=run_id).version)
    for alias in aliases:
        client.set_registered_model_alias(name, alias, str(version))
    return ModelRef(name, version, f"models:/{name}/{version}")


def set_alias(name: str, alias: str, version: int) -> None:
    """Point ``models:/name@alias`` at ``version`` (e.g. promote to 'champion')."""
    MlflowClient().set_registered_model_alias(name, alias, str(version))


def get_alias_version(name: str, alias: str) -> int | None:
    """The version ``alias`` points at, or None when the alias (or the model) does not exist."""
    try:
        return int(MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def _parse_models_uri(uri: str) -> tuple[str, int]:
    match = _MODELS_URI.match(uri)
    if match is None:
        raise ValueError(f"{uri!r} is not a registry URI; use models:/<name>/<version> or models:/<name>@<alias>")
    name = match["name"]
    if match["version"] is not None:
        return name, int(match["version"])
    version = get_alias_version(name, match["alias"])
    if version is None:
        raise ValueError(f"{uri!r}: registered model {name!r} has no alias {match['alias']!r}")
    return name, version


def resolve_model_uri(uri_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A local folder for a model: paths (and Hugging Face ids) come back as they are; ``models:/`` URIs are
    downloaded once into ``cache_dir`` (default ``<state>/cache/models``) and that copy is returned."""
    if not uri_or_path.startswith("models:/"):
        return uri_or_path
    name, version = _parse_models_uri(uri_or_path)
    source = MlflowClient().get_model_version_download_uri(name, str(version))
    root = Path(cache_dir) if cache_dir is not None else _configured_state().cache / "models"
    # The source hash keeps a cache from an older (deleted) store from answering for a new version of that number.
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:8]
    target = root / _slug(name) / f"v{version}-{digest}"
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".download-", dir=target.parent)
    try:
        downloaded = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=scratch)
        try:
            os.replace(downloaded, target)
        except OSError:
            if not target.exists():  # else another process finished the same download first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)
