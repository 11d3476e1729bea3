"""Run records: ``runs/<run_id>/run.json``, plain JSON that refers to artifacts by stage and key.

A run is one pass of the pipeline under one id: the Prefect flow run's name, the MLflow parent run's tag and
name, the lineage tag of every model version it registers. Its record says where each stage stands and which
artifact it produced or reused; it holds no path into any other folder, so deleting one run never breaks another.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from tasks.run_store.locks import now_iso

RunStatus = Literal["pending", "running", "completed", "failed", "crashed"]
StageStatus = Literal["running", "completed", "failed"]
RUN_STATUSES = ("pending", "running", "completed", "failed", "crashed")


def new_run_id(when: datetime | None = None, suffix: str | None = None) -> str:
    """A sortable run id, ``YYYYMMDD-HHMMSS-xxxxxx`` (UTC; the suffix random unless given)."""
    stamp = (when or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{suffix or secrets.token_hex(3)}"


@dataclass
class StageEntry:
    """Where one stage of a run stands (label: 'sft', 'ppo-iteration-2', ...)."""

    stage: str
    """The stage (module) name: 'ppo-iteration' for label 'ppo-iteration-2'."""
    key: str
    """Key of the artifact this stage uses: computed here or reused."""
    status: StageStatus = "running"
    """running / completed / failed."""
    cached_from: str | None = None
    """The run that computed the artifact, when it is not this run (a cached stage)."""
    mlflow_run_id: str | None = None
    """The stage's nested MLflow run in this run."""
    models: dict[str, str] = field(default_factory=dict)
    """Role -> ``models:/name/version`` registered for this run (e.g. {'policy': 'models:/rlhf-policy/3'})."""
    error: str | None = None
    """One-line error of a failed stage."""
    updated: str = field(default_factory=now_iso)
    """UTC ISO time of the last change."""


@dataclass
class RunRecord:
    """One pipeline run."""

    run_id: str
    """The run's id (see module docstring)."""
    name: str
    """Config name (e.g. 'demo')."""
    preset: str | None = None
    """The preset the config was resolved over (None: the code defaults); runs are described by what they change."""
    created: str = field(default_factory=now_iso)
    """UTC ISO creation time."""
    status: RunStatus = "running"
    """running / completed / failed / crashed (killed without a word; found by ``rlhf runs``); pending: created by a
    sweep, not started yet."""
    error: str | None = None
    """One line on why it failed or crashed."""
    ended: str | None = None
    """UTC ISO time it completed, failed or crashed."""
    prefect_flow_run_id: str | None = None
    """The Prefect flow run executing (or last executing) it."""
    mlflow_run_id: str | None = None
    """The MLflow parent run."""
    reruns: dict[str, int] = field(default_factory=dict)
    """Stage name or label -> times ``rlhf stage`` asked to recompute it (part of its key)."""
    amendments: list[dict[str, Any]] = field(default_factory=list)
    """Overrides given to ``rlhf resume`` after the start ({'time', 'overrides'})."""
    stages: dict[str, StageEntry] = field(default_factory=dict)
    """Label -> entry, in the order stages started."""
    sweep_id: str | None = None
    """The sweep this run is a cell of (``rlhf sweep``), or None."""

    def rerun_of(self, label: str, stage: str) -> int:
        """The rerun number that enters the key of ``label`` (a label's own, else its stage's)."""
        return self.reruns.get(label, self.reruns.get(stage, 0))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        stages = {label: StageEntry(**entry) for label, entry in data.pop("stages", {}).items()}
        record = cls(**data, stages=stages)
        if record.status not in RUN_STATUSES:
            raise ValueError(f"unknown status {record.status!r}")
        return record
