"""MLflow runs of a pipeline run and its stages, and what is logged into them."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from tasks.tracking.setup import TrackingUnavailable, ensure_experiment

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

RUN_ID_TAG = "rlhf.run_id"
KIND_TAG = "rlhf.kind"
STAGE_TAG = "rlhf.stage"
SWEEP_TAG = "rlhf.sweep_id"
PARENT_TAG = "mlflow.parentRunId"
"""MLflow's own tag: the UI shows a run with it nested under that run."""
TRUNCATED = "...[truncated]"



@contextmanager
def pipeline_run(experiment: str, rlhf_run_id: str, run_name: str, params: Mapping[str, object] | None = None,
                 tags: Mapping[str, str] | None = None, amended: bool = False) -> Iterator[str]:
    """The parent run of rlhf run ``rlhf_run_id`` (found by its tag, or started); yields its MLflow id.

    Ends FINISHED, or FAILED on an error. Finding it by tag makes a retry or resume of the run continue the same
    parent even if the first attempt died before it could record the id.
    """
    with _tagged_run(experiment, "pipeline", RUN_ID_TAG, rlhf_run_id, run_name, params, tags, amended) as run_id:
        yield run_id


@contextmanager
def sweep_run(experiment: str, sweep_id: str, run_name: str, params: Mapping[str, object] | None = None,
              tags: Mapping[str, str] | None = None) -> Iterator[str]:
    """The parent run of sweep ``sweep_id`` (found by its tag, or started), under which each of the sweep's pipeline
    runs is nested; yields its MLflow id. Ends FINISHED, or FAILED on an error (a resume continues it)."""
    with _tagged_run(experiment, "sweep", SWEEP_TAG, sweep_id, run_name, params, tags) as run_id:
        yield run_id


@contextmanager
def _tagged_run(experiment: str, kind: str, id_tag: str, identity: str, run_name: str,
                params: Mapping[str, object] | None, tags: Mapping[str, str] | None,
                amended: bool = False) -> Iterator[str]:
    """The run of kind ``kind`` whose ``id_tag`` is ``identity``: found by those tags, or started. Started nested
    when this thread has a run active: a sweep's pipeline runs at ``--concurrency 1`` run in the sweep's thread, under
    its run (as their parent tag says too)."""
    experiment_id = ensure_experiment(experiment)
    found = MlflowClient().search_runs([experiment_id], f"tags.`{id_tag}` = '{identity}' and "
                                                        f"tags.`{KIND_TAG}` = '{kind}'", max_results=1)
    all_tags = {KIND_TAG: kind, id_tag: identity, **(tags or {})}
    if found:
        started = mlflow.start_run(run_id=found[0].info.run_id, tags=all_tags, nested=True)
    else:
        started = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=all_tags, nested=True)
    with started as run:
        if params:
            log_params_flat(params, run.info.run_id, amended)
        yield run.info.run_id


@contextmanager
def stage_run(label: str, parent_run_id: str, tags: Mapping[str, str] | None = None,
              run_id: str | None = None) -> Iterator[str]:
    """A nested run for one stage under ``parent_run_id`` (``run_id`` continues an earlier one); yields its id."""
    all_tags = {STAGE_TAG: label, KIND_TAG: "stage", **(tags or {})}
    if run_id is None:
        experiment_id = MlflowClient().get_run(parent_run_id).info.experiment_id
        started = mlflow.start_run(experiment_id=experiment_id, run_name=label, nested=True,
                                   parent_run_id=parent_run_id, tags=all_tags)
    else:
        started = mlflow.start_run(run_id=run_id, nested=True, tags=all_tags)
    with started as run:
        yield run.info.run_id


def end_run(run_id: str, status: str = "KILLED") -> None:
    """Close a run a killed process left RUNNING (``rlhf runs`` finds those); a run the store lost is skipped."""
    client = MlflowClient()
    try:
        running = client.get_run(run_id).info.status == "RUNNING"
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return
    if running:
        client.set_terminated(run_id, status)


def set_tags(run_id: str, tags: Mapping[str, str]) -> None:
    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, str(value))


# --------------------------------------------------------------------------------------------- logging


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Metrics (e.g. ``{'ppo/policy/clipfrac': 0.1}``) at ``step``, in batches."""
    now = int(time.time() * 1000)
    entries = [Metric(key, float(value), now, step or 0) for key, value in metrics.items()]
    _log_batch(run_id, entries)


def _log_batch(run_id: str, entries: Sequence[Metric]) -> None:
    client = MlflowClient()
    for chunk in _chunks(list(entries), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=list(chunk))


def _param_value(key: str, value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        log.warning("param %s is %d characters; MLflow keeps %d, so it is truncated", key, len(text),
                    MAX_PARAM_VAL_LENGTH)
        text = text[: MAX_PARAM_VAL_LENGTH - len(TRUNCATED)] + TRUNCATED
    return text


def log_params_flat(params: Mapping[str, object], run_id: str, amended: bool = False) -> dict[str, str]:
    """Flat params in batches, values cut to MLflow's limit; returns what was sent.

    Params are write-once: keys already logged with the same value are skipped (a resumed run logs its config
    again); a different value raises ValueError naming the keys, unless the run's config was ``amended``
    (``rlhf resume KEY=VALUE``): then each changed value goes to a tag ``rlhf.amended.<key>`` ('old -> new').
    """
    client = MlflowClient()
    existing = client.get_run(run_id).data.params
    values = {key: _param_value(key, value) for key, value in params.items()}
    changed = {k: (existing[k], v) for k, v in values.items() if k in existing and existing[k] != v}
    if changed and amended:
        set_tags(run_id, {f"rlhf.amended.{k}": f"{old} -> {new}" for k, (old, new) in changed.items()})
    elif changed:
        shown = "; ".join(f"{k}: logged {old!r}, now {new!r}" for k, (old, new) in sorted(changed.items())[:10])
        raise ValueError(f"MLflow run {run_id} already has different values for params ({shown}); params are "
                         "write-once: start a new run, or log the changing value as a metric or tag")
    fresh = {k: v for k, v in values.items() if k not in existing}
    for chunk in _chunks(list(fresh.items()), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
    return fresh


def log_tables(run_ids: Sequence[str], tables: Mapping[str, tuple[Path, str, str]]) -> None:
    """Parquet tables as MLflow datasets (the run page's 'Datasets used', the runs table's dataset column):
    name -> (path, context such as 'training' / 'evaluation', content digest). Each run logs them once."""
    import pandas as pd
    from mlflow.data import from_pandas
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    client = MlflowClient()
    inputs = []
    for name, (path, context, digest) in tables.items():
        with warnings.catch_warnings():  # MLflow's hints on source types and integer columns are not for users
            warnings.simplefilter("ignore", UserWarning)
            dataset = from_pandas(pd.read_parquet(path), source=str(path), name=name, digest=digest[:36])
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    for run_id in run_ids:
        logged = {(d.dataset.name, d.dataset.digest) for d in client.get_run(run_id).inputs.dataset_inputs}
        fresh = [i for i in inputs if (i.dataset.name, i.dataset.digest) not in logged]
        if fresh:
            client.log_inputs(run_id, datasets=fresh)


def run_url(run_id: str, base: str | None = None) -> str | None:
    """The run's page in the MLflow UI: on the tracking server, or on ``base`` (a local ``mlflow ui``); None
    for a local store without ``base``."""
    uri = base or mlflow.get_tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return None
    experiment_id = MlflowClient().get_run(run_id).info.experiment_id
    # MLflow 3's UI opens a fresh browser on its GenAI views whatever the experiment's kind; this picks training runs
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def set_run_name(run_id: str, name: str) -> None:
    MlflowClient().set_tag(run_id, "mlflow.runName", name)


def set_description(run_id: str, markdown: str) -> None:
    """The run page's description (markdown)."""
    MlflowClient().set_tag(run_id, "mlflow.note.content", markdown)


def log_figure(run_id: str, fig: Figure, artifact_path: str) -> None:
    MlflowClient().log_figure(run_id, fig, artifact_path)


def log_file(run_id: str, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
    """Copy a local file (or folder) into the run's artifacts under ``artifact_path``."""
    local = Path(path)
    client = MlflowClient()
    if local.is_dir():
        client.log_artifacts(run_id, str(local), artifact_path)
    else:
        client.log_artifact(run_id, str(local), artifact_path)


class StageTracker:
    """Live metrics of one stage: to its MLflow run (chosen curves also to the parent), and to a JSON-lines file
    kept in the artifact, so that a later run reusing the artifact shows the same curves (:func:`replay_metrics`).

    Training never waits on the tracking server: :meth:`log` appends to the file and queues the values, which a
    :class:`MetricSender` thread sends in order. While the server is away they wait in the queue (and in the file);
    when it is back they go through. :meth:`flush` waits for the queue to empty, at most ``drain_seconds``.
    """

    def __init__(self, run_id: str, parent_run_id: str, record: Path, flush_every: int = 1,
                 drain_seconds: float | None = None) -> None:
        self.run_id, self.parent_run_id, self.record, self.flush_every = run_id, parent_run_id, record, flush_every
        self._pending: dict[str, list[Metric]] = {run_id: [], parent_run_id: []}
        self._calls = 0
        self._sender = MetricSender()
        self.drain_seconds = DRAIN_SECONDS if drain_seconds is None else drain_seconds

    def log(self, metrics: Mapping[str, float], step: int, to_parent: Iterable[str] = ()) -> None:
        """``metrics`` at ``step`` to the stage run; the keys in ``to_parent`` to the parent run too."""
        now = int(time.time() * 1000)
        values = {k: float(v) for k, v in metrics.items()}
        parent = {k: values[k] for k in to_parent if k in values}
        with open(self.record, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "metrics": values, "parent": sorted(parent)}) + "\n")
        self._pending[self.run_id] += [Metric(k, v, now, step) for k, v in values.items()]
        self._pending[self.parent_run_id] += [Metric(k, v, now, step) for k, v in parent.items()]
        self._calls += 1
        if self._calls % self.flush_every == 0:
            self._queue_pending()

    def _queue_pending(self) -> None:
        for run_id, entries in self._pending.items():
            if entries:
                self._sender.put(run_id, entries)
                self._pending[run_id] = []

    def flush(self) -> None:
        """Send everything logged so far; TrackingUnavailable when the server has not taken it in time."""
        self._queue_pending()
        self._sender.drain(self.drain_seconds, self.record)


DRAIN_SECONDS = 600.0
"""How long a stage's end waits for a tracking server that went away to take its queued metrics."""


class MetricSender:
    """Sends queued metric batches to MLflow from a daemon thread, in order. A batch that fails for a reason that
    may pass (the server is down or busy) is retried with pauses growing to :data:`MAX_PAUSE_SECONDS`; one MLflow
    refuses outright is dropped with a warning (the values stay in the stage's metrics file)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[str, list[Metric]]] = deque()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    def put(self, run_id: str, entries: Sequence[Metric]) -> None:
        with self._changed:
            self._queue.append((run_id, list(entries)))
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlflow-metrics", daemon=True)
                self._thread.start()

    @property
    def queued(self) -> int:
        """Metric values not sent yet."""
        with self._changed:
            return sum(len(entries) for _, entries in self._queue)

    def drain(self, timeout: float, record: Path | None = None) -> None:
        """Wait until every queued batch is sent; TrackingUnavailable after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    kept = f"; they are kept in {record}" if record is not None else ""
                    raise TrackingUnavailable(
                        f"MLflow at {mlflow.get_tracking_uri()} has not taken {self.queued} metric values for "
                        f"{timeout:.0f} s ({type(self.last_error).__name__}: {str(self.last_error).splitlines()[0]})"
                        f"{kept}; `rlhf resume` once it is back")
                self._changed.wait(min(left, 1.0))

    def _loop(self) -> None:
        pause = 1.0
        while True:
            with self._changed:
                if not self._queue:  # all sent: the thread ends (the next put starts another)
                    self._thread = None
                    return
                run_id, entries = self._queue[0]
            try:
                _log_batch(run_id, entries)
            except Exception as error:  # noqa: BLE001 (whatever the client raises, training must not see it)
                if not _may_pass(error):
                    log.warning("MLflow refused %d metric values of run %s (%s: %s); they stay in the stage's "
                                "metrics file", len(entries), run_id, type(error).__name__,
                                (str(error).splitlines() or [""])[0])
                else:
                    if self.last_error is None:
                        log.warning("MLflow is not answering (%s); metrics wait in a queue and are sent when it "
                                    "is back; training goes on", type(error).__name__)
                    self.last_error = error
                    time.sleep(pause)
                    pause = min(pause * 2, MAX_PAUSE_SECONDS)
                    continue
            with self._changed:
                self._queue.popleft()
                if self.last_error is not None and not isinstance(self.last_error, MlflowException):
                    log.warning("MLflow is back; sending the queued metrics")
                self.last_error = None
                pause = 1.0
                self._changed.notify_all()


MAX_PAUSE_SECONDS = 30.0
"""Longest pause between two tries of a metric batch while the tracking server is away."""


def _may_pass(error: BaseException) -> bool:
    """A transport or server-side failure (no connection, timeouts, 5xx, rate limits), not a refusal of the values
    (MLflow's client reports a refused connection as INTERNAL_ERROR after its own retries)."""
    if isinstance(error, MlflowException):
        return error.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "INTERNAL_ERROR")
    return isinstance(error, (OSError, TimeoutError))  # ConnectionError and requests' errors are OSErrors


def logged_keys(record: Path) -> set[str]:
    """The metric keys a :class:`StageTracker` file holds (empty when there is none)."""
    if not record.is_file():
        return set()
    return {key for line in record.read_text(encoding="utf-8").splitlines() if line.strip()
            for key in json.loads(line)["metrics"]}


def replay_metrics(record: Path, run_id: str, parent_run_id: str) -> int:
    """Log a :class:`StageTracker` file into new runs (a cached stage); the last value of a (step, key) wins, as a
    resumed stage logs the steps after its last checkpoint twice. Returns the values logged."""
    if not record.is_file():
        return 0
    latest: dict[tuple[bool, int, str], float] = {}
    for line in record.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        for key, value in entry["metrics"].items():
            latest[(False, int(entry["step"]), key)] = value
            if key in entry.get("parent", ()):
                latest[(True, int(entry["step"]), key)] = value
    now = int(time.time() * 1000)
    for to_parent, target in ((False, run_id), (True, parent_run_id)):
        _log_batch(target, [Metric(k, v, now, s) for (p, s, k), v in sorted(latest.items()) if p == to_parent])
    return len(latest)
