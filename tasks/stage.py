"""The stage contract, and the one way every stage runs.

A stage module (tasks/data_prep.py, tasks/sft.py, ...) defines:

    Config     frozen dataclass: the config slice the stage is given, built by ``Config.of(pipeline_config, ...)``.
               Its key covers every field, so the stage cannot read a setting that is not in its key.
    Inputs     frozen dataclass of the artifacts (``Artifact`` / ``ArtifactPart``) it reads.
    Result     dataclass of plain values: the artifact's JSON record (paths relative to the artifact folder).
    compute(cfg, inputs, ctx) -> Result     writes the artifact's files into ``ctx.out``; live metrics via ctx.tracker
    publish(cfg, result, pub) -> None       this run's MLflow view: final metrics, files, registered models, aliases
                                            (the config slice is logged as params before it; ``pub.artifact`` is
                                            the artifact whose typed ``result`` it gets)
    STAGE = Stage(NAME, compute, publish, Result);  <name>_task = stage_task(STAGE, retries=...)

:func:`run_stage` derives the key from (stage, Config, Inputs, code, rerun number), reuses the published artifact
or computes it under the key's claim, then publishes it for this run: once, idempotently, with lineage tags, in a
nested MLflow run. Every step lands in the run record, so a resume, a Prefect retry and a cached rerun all end
with the same artifacts, the same lineage and no duplicate model versions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prefect import Task, task

from tasks import tracking
from tasks.retries import retry_on_transient_io
from tasks.run_store import ActiveRun, Artifact, RunStore, code_version, stage_key
from tasks.tracking.registry import ModelRef
from tasks.tracking.runs import StageTracker
from tasks.typed_yaml import flatten_for_params

if TYPE_CHECKING:
    from tasks.config import TrackingSection

log = logging.getLogger(__name__)

METRICS_LOG = "metrics.jsonl"
"""The stage's live metrics, kept in its artifact (replayed into the MLflow run of a later run that reuses it)."""

R = TypeVar("R")


@dataclass(frozen=True)
class StageContext:
    """What ``compute`` gets besides its config slice and inputs."""

    out: Path
    """The artifact's folder while it is written (published as a whole when compute returns)."""
    work: Path
    """This key's work folder: kept when an attempt fails (checkpoints to resume from), cleared on publication."""
    tracker: StageTracker
    """Live metrics into the stage's MLflow run (and selected curves into the pipeline's parent run)."""
    label: str
    """'sft', 'ppo-iteration-2', ...: the stage's name in this run."""
    stage: str
    store: RunStore
    resume: Path
    """Where compute leaves resume state for a later stage (a PPO iteration's last checkpoint): published beside
    the artifact, outside its checksums, and prunable (``RunStore.resume_state`` reads it back)."""

    def scratch(self, kind: str, identity: Any) -> Path:
        """A folder that outlives this stage's attempts and keys, named by a digest of ``identity``: for what must
        survive a change of config, e.g. pairs exported for people to label before the labels file is known."""
        return self.store.scratch_dir(f"{self.stage}-{kind}", stage_key(f"{self.stage}-{kind}", identity, {}))


@dataclass(frozen=True)
class Stage(Generic[R]):
    """One stage: its name, compute and publish functions and its result type."""

    name: str
    compute: Callable[[Any, Any, StageContext], R]
    publish: Callable[[Any, R, Publication], None]
    result_type: type[R]

    @property
    def module(self) -> str:
        """The module that defines the stage: its code, with what it imports, enters the stage's keys."""
        return self.compute.__module__

    def result(self, artifact: Artifact) -> R:
        """The typed result record of one of this stage's artifacts."""
        if artifact.stage != self.name:
            raise ValueError(f"{artifact.identity()} is not a {self.name} artifact")
        return self.result_type(**artifact.result)


@dataclass
class RunContext:
    """The run every stage of it belongs to: the store, the run (held), the MLflow parent run and registry names."""

    store: RunStore
    run: ActiveRun
    parent_run_id: str
    names: TrackingSection
    """Registered-model names (``tracking.*``): where this run publishes, not part of any key."""

    @property
    def run_id(self) -> str:
        return self.run.run_id


class Publication:
    """What ``publish`` may do for this run: log the artifact's results to MLflow and register its models."""

    def __init__(self, run_context: RunContext, label: str, artifact: Artifact, mlflow_run_id: str,
                 cached_from: str | None) -> None:
        self.run_context, self.label, self.artifact, self.mlflow_run_id = run_context, label, artifact, mlflow_run_id
        self.cached_from = cached_from
        self.names = run_context.names
        self.models: dict[str, str] = {}
        self._curves: set[str] | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Final metrics of the stage; keys it already logged as curves while computing are left out (their last
        point is the final value, and a second point at another step would bend the curve)."""
        final = {k: v for k, v in metrics.items() if k not in self._curve_keys()}
        if final:
            tracking.log_metrics(self.mlflow_run_id, final, step)

    def _curve_keys(self) -> set[str]:
        if self._curves is None:
            self._curves = tracking.logged_keys(self.artifact.folder / METRICS_LOG)
        return self._curves

    def log_params(self, params: Mapping[str, object]) -> None:
        tracking.log_params_flat(params, self.mlflow_run_id)

    def log_headline(self, metrics: Mapping[str, float], step: int | None = None,
                     tags: Mapping[str, object] | None = None) -> None:
        """Results the pipeline's parent run carries too (its columns when runs are compared), at ``step``."""
        tracking.log_metrics(self.run_context.parent_run_id, metrics, step)
        if tags:
            tracking.set_tags(self.run_context.parent_run_id, {k: str(v) for k, v in tags.items()})

    def log_tables(self, tables: Mapping[str, tuple[str, str]]) -> None:
        """Parquet tables of the artifact as MLflow datasets of the stage run and the parent run:
        name -> (relative path, context such as 'training')."""
        files = self.artifact.record.files
        tracking.log_tables([self.mlflow_run_id, self.run_context.parent_run_id],
                            {name: (self.artifact.path(relative), context, files.get(relative, {}).get("sha256", ""))
                             for name, (relative, context) in tables.items()})

    def tag_model(self, uri: str, tags: Mapping[str, object]) -> None:
        """Tags on a registered version (its evaluation, hacking status), shown in the model registry."""
        tracking.tag_model_version(uri, tags)

    def log_files(self, relatives: Sequence[str], artifact_path: str | None = None) -> None:
        """Files (or folders) of the artifact, as MLflow artifacts of the stage run."""
        for relative in relatives:
            tracking.log_file(self.mlflow_run_id, self.artifact.path(relative), artifact_path)

    def set_tags(self, tags: Mapping[str, object]) -> None:
        tracking.set_tags(self.mlflow_run_id, {k: str(v) for k, v in tags.items()})

    def register(self, role: str, name: str, folder: str | Path, aliases: Sequence[str] = ("candidate",),
                 usage: Mapping[str, Any] | None = None) -> ModelRef:
        """Register a model folder (relative to the artifact, or an outside one the artifact chose) as a version
        of ``name`` for this run (idempotent), tagged with the run id, stage, artifact key, role and, for a cached
        stage, the run it came from. ``usage``: how the version's pyfunc uses it (a policy's ``generation``)."""
        lineage = {"rlhf.run_id": self.run_context.run_id, "rlhf.stage": self.label, "rlhf.role": role,
                   "rlhf.artifact_key": self.artifact.identity(), "rlhf.produced_by": self.artifact.record.produced_by}
        if self.cached_from:
            lineage["rlhf.cached_from"] = self.cached_from
        description = (f"{role} of rlhf run {self.run_context.run_id}, stage {self.label}, artifact "
                       f"{self.artifact.identity()}" + (f" (computed by run {self.cached_from})" if self.cached_from
                                                        else ""))
        path = Path(folder) if Path(folder).is_absolute() else self.artifact.path(str(folder))
        reference = self._reference(path)
        if reference is not None:
            lineage["rlhf.model_storage"] = "reference"
        ref = tracking.register_model(path, name, self.mlflow_run_id, lineage, aliases, description, reference, usage)
        self.models[role] = ref.uri
        return ref

    def _reference(self, path: Path) -> tracking.ArtifactReference | None:
        """What a version registered by reference points at (``tracking.model_storage=reference``); None = upload
        the files (the default, and for a folder outside the artifact, which the state folder does not own)."""
        folder, root = path.resolve(), self.artifact.folder.resolve()
        if self.names.model_storage != "reference" or not folder.is_relative_to(root):
            return None
        return tracking.ArtifactReference(self.artifact.identity(), folder.relative_to(root).as_posix())

    def alias_version(self, name: str, alias: str) -> int | None:
        return tracking.get_alias_version(name, alias)

    def set_alias(self, name: str, alias: str, version: int) -> None:
        tracking.set_alias(name, alias, version)

    def registered_input(self, name: str, role: str) -> str | None:
        """The ``models:/`` URI this run registered for ``role`` from the artifact behind input ``name`` (e.g. the
        policy heldout-eval judged: the version its ppo-iteration registered); None when there is none."""
        identity = str(self.artifact.record.inputs.get(name, ""))
        for entry in self.run_context.run.record.stages.values():
            if (entry.status == "completed" and role in entry.models
                    and (identity == f"{entry.stage}/{entry.key}" or identity.startswith(f"{entry.stage}/{entry.key}/"))):
                return entry.models[role]
        return None

    def alias(self, uri: str, alias: str) -> ModelRef:
        """Point ``alias`` of the model ``uri`` names at the version it names (``models:/name/version``)."""
        ref = tracking.parse_model_uri(uri)
        tracking.set_alias(ref.name, alias, ref.version)
        return ref


def run_stage(stage: Stage, label: str, cfg: Any, inputs: Any, run_context: RunContext) -> Artifact:
    """Reuse or compute the artifact of (``stage``, ``cfg``, ``inputs``) and publish it for this run."""
    rerun = run_context.run.record.rerun_of(label, stage.name)
    key = stage_key(stage.name, cfg, shallow_fields(inputs), rerun, tracking.model_identity, stage.module)
    entry = run_context.run.stage(label)
    try:
        artifact = run_context.store.artifact(stage.name, key)
        if artifact is not None and entry is not None and entry.key == key and entry.status == "completed":
            return artifact  # done in this run already (a resume, or a rerun of a finished run)
        if artifact is None:
            with run_context.store.claim(stage.name, key, run_context.run_id) as claim:
                artifact = run_context.store.artifact(stage.name, key)  # another run may have finished it meanwhile
                if artifact is None:
                    return _compute(stage, label, key, cfg, inputs, run_context, claim)
        cached_from = None if artifact.record.produced_by == run_context.run_id else artifact.record.produced_by
        log.info("%s: reusing artifact %s%s", label, artifact.identity(),
                 f" computed by run {cached_from}" if cached_from else "")
        run_context.run.stage_started(label, stage.name, key, cached_from)
        _publish(stage, label, cfg, artifact, run_context, cached_from)
        return artifact
    except BaseException as error:
        if run_context.run.stage(label) is not None:
            first_line = f"{type(error).__name__}: {error}".splitlines()[0]
            run_context.run.stage_update(label, status="failed", error=first_line)
        raise


def _compute(stage: Stage, label: str, key: str, cfg: Any, inputs: Any, run_context: RunContext,
             claim: Any) -> Artifact:
    entry = run_context.run.stage_started(label, stage.name, key)
    log.info("%s: computing artifact %s/%s", label, stage.name, key)
    tags = _tags(run_context, stage, key)
    with tracking.stage_run(label, run_context.parent_run_id, tags, entry.mlflow_run_id) as mlflow_id:
        run_context.run.stage_update(label, mlflow_run_id=mlflow_id)
        tracker = StageTracker(mlflow_id, run_context.parent_run_id, claim.work / METRICS_LOG)
        result = stage.compute(cfg, inputs, StageContext(claim.staging, claim.work, tracker, label, stage.name,
                                                         run_context.store, claim.resume_staging))
        tracker.flush()
        if tracker.record.exists():
            tracker.record.rename(claim.staging / METRICS_LOG)
        artifact = claim.publish(asdict(result), cfg, shallow_fields(inputs), code_version(stage.module))
        _publish_into(stage, label, cfg, artifact, run_context, mlflow_id, None)
    return artifact


def _publish(stage: Stage, label: str, cfg: Any, artifact: Artifact, run_context: RunContext,
             cached_from: str | None) -> None:
    entry = run_context.run.stage(label)
    tags = _tags(run_context, stage, artifact.key) | ({"rlhf.cached_from": cached_from} if cached_from else {})
    if cached_from:  # the parent says which stages this run reused, and from which run
        tracking.set_tags(run_context.parent_run_id, {f"rlhf.cached_from.{label}": cached_from})
    with tracking.stage_run(label, run_context.parent_run_id, tags, entry.mlflow_run_id) as mlflow_id:
        first = entry.mlflow_run_id is None
        run_context.run.stage_update(label, mlflow_run_id=mlflow_id)
        if first and cached_from:  # the curves of the run that computed it
            tracking.replay_metrics(artifact.path(METRICS_LOG), mlflow_id, run_context.parent_run_id)
        _publish_into(stage, label, cfg, artifact, run_context, mlflow_id, cached_from)


def _publish_into(stage: Stage, label: str, cfg: Any, artifact: Artifact, run_context: RunContext, mlflow_id: str,
                  cached_from: str | None) -> None:
    publication = Publication(run_context, label, artifact, mlflow_id, cached_from)
    publication.log_params(flatten_for_params(cfg))
    stage.publish(cfg, stage.result(artifact), publication)
    run_context.run.stage_update(label, status="completed", models=dict(publication.models), error=None)


def shallow_fields(inputs: Any) -> dict[str, Any]:
    """An Inputs dataclass as {field: value}, values untouched (``asdict`` would unpack the artifacts in it)."""
    return {f.name: getattr(inputs, f.name) for f in fields(inputs)}


def _tags(run_context: RunContext, stage: Stage, key: str) -> dict[str, str]:
    return {"rlhf.run_id": run_context.run_id, "rlhf.artifact_key": f"{stage.name}/{key}"}


def stage_task(stage: Stage, retries: int = 1, retry_delay_seconds: float = 5) -> Task:
    """The Prefect task of ``stage``: task runs are named by label ('ppo-iteration-2'); retries only for transient
    I/O; no Prefect result persistence or caching (the run store owns results, as JSON)."""
    def body(label: str, cfg: Any, inputs: Any, run_context: RunContext) -> Artifact:
        return run_stage(stage, label, cfg, inputs, run_context)

    body.__name__ = body.__qualname__ = stage.name.replace("-", "_")
    return task(name=stage.name, task_run_name="{label}", retries=retries, retry_delay_seconds=retry_delay_seconds,
                retry_condition_fn=retry_on_transient_io, persist_result=False, result_serializer="json",
                log_prints=True)(body)
