"""Everything a pipeline writes locally lives under ONE state directory (default ``./.rlhf_state``).

    .rlhf_state/
      runs/<run_id>/run.json   one RunRecord per pipeline run (plus that run's config, summary, tables)
      cache/                   stage caches keyed by config hashes; downloaded models:/ artifacts
      mlflow.db                MLflow's SQLite store (when MLFLOW_TRACKING_URI is not set)
      mlartifacts/             MLflow's artifact root
      prefect/                 PREFECT_HOME for Prefect's temporary local server

Nothing is written to the home directory. Run records are written atomically, so a killed process leaves the
previous record, never half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

DEFAULT_STATE_DIR = ".rlhf_state"
RUN_FILE = "run.json"
#: ``load_run("latest")`` is the newest run.
LATEST = "latest"

RunStatus = Literal["running", "completed", "failed"]
StageStatus = Literal["pending", "running", "completed", "failed", "skipped"]


class StateError(LookupError):
    """A run is missing or its record unreadable; the message names the path and what exists."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def new_run_id() -> str:
    """A sortable, unique run id: UTC timestamp to the microsecond plus a short random suffix."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f") + "-" + secrets.token_hex(2)


@dataclass
class StageRecord:
    """Where one stage of a run stands."""

    status: StageStatus = "pending"
    """pending / running / completed / failed / skipped."""
    result: dict[str, Any] = field(default_factory=dict)
    """JSON-able summary the stage returned: paths, models:/ URIs, headline metrics."""
    error: str | None = None
    """One-line error of a failed stage."""
    updated: str = field(default_factory=_now)
    """UTC ISO time of the last change."""


@dataclass
class RunRecord:
    """One pipeline run, saved as ``runs/<run_id>/run.json``."""

    run_id: str
    """Sortable id from ``new_run_id``."""
    name: str
    """Config name of the run (e.g. 'demo')."""
    created: str = field(default_factory=_now)
    """UTC ISO creation time."""
    status: RunStatus = "running"
    """running / completed / failed."""
    config_path: str | None = None
    """The resolved config this run uses (YAML, loadable with ``load_config``)."""
    mlflow_run_id: str | None = None
    """The parent MLflow run."""
    stages: dict[str, StageRecord] = field(default_factory=dict)
    """Stage name (e.g. 'ppo-iteration-2') -> its record, in the order stages started."""
    summary_path: str | None = None
    """Final summary (Markdown / JSON) once the run ends."""

    def set_stage(self, stage: str, status: StageStatus, result: dict[str, Any] | None = None,
                  error: str | None = None) -> StageRecord:
        """Record a stage's new status (keeps its earlier result unless a new one is given)."""
        previous = self.stages.get(stage)
        kept = previous.result if previous is not None and result is None else (result or {})
        self.stages[stage] = StageRecord(status, dict(kept), error)
        return self.stages[stage]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """Inverse of ``to_dict``."""
        stages = {k: StageRecord(**v) for k, v in data.get("stages", {}).items()}
        return cls(**{**data, "stages": stages})


class StateDir:
    """The state directory and the run records under it."""

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_STATE_DIR) -> None:
        # Absolute now, so a later chdir (Prefect workers, tests) cannot move the state.
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"StateDir({str(self.root)!r})"

    @property
    def runs(self) -> Path:
        """Folder of the run folders."""
        return self.root / "runs"

    @property
    def cache(self) -> Path:
        """Folder of stage caches and downloaded models."""
        return self.root / "cache"

    @property
    def mlflow_db(self) -> Path:
        """MLflow's SQLite file."""
        return self.root / "mlflow.db"

    @property
    def mlflow_uri(self) -> str:
        """Tracking URI of ``mlflow_db``."""
        return f"sqlite:///{self.mlflow_db}"

    @property
    def mlartifacts(self) -> Path:
        """MLflow's artifact root."""
        return self.root / "mlartifacts"

    @property
    def prefect(self) -> Path:
        """PREFECT_HOME."""
        return self.root / "prefect"

    def ensure(self) -> StateDir:
        """Create the folders; returns self."""
        for folder in (self.runs, self.cache, self.mlartifacts, self.prefect):
            folder.mkdir(parents=True, exist_ok=True)
        return self

    def run_dir(self, run_id: str) -> Path:
        """Folder of one run (not created)."""
        if not run_id or "/" in run_id or "\\" in run_id or run_id in (".", ".."):
            raise StateError(f"{run_id!r} is not a run id (expected e.g. {new_run_id()})")
        return self.runs / run_id

    def save_run(self, record: RunRecord) -> Path:
        """Write ``runs/<run_id>/run.json`` atomically; returns its path."""
        path = self.run_dir(record.run_id) / RUN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{RUN_FILE}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(record.to_dict(), handle, indent=2)
                handle.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def new_run(self, name: str, config_path: str | None = None) -> RunRecord:
        """Create, save and return a fresh 'running' record."""
        record = RunRecord(run_id=new_run_id(), name=name, config_path=config_path)
        self.save_run(record)
        return record

    def list_runs(self) -> list[RunRecord]:
        """Every run, newest first. Folders without a run.json (nothing saved yet) are skipped."""
        if not self.runs.is_dir():
            return []
        records = [self._read(p) for p in self.runs.glob(f"*/{RUN_FILE}")]
        return sorted(records, key=lambda r: (r.created, r.run_id), reverse=True)

    def load_run(self, run_id: str) -> RunRecord:
        """The record of ``run_id`` ('latest' = newest); StateError lists the existing ids when it is missing."""
        if run_id == LATEST:
            runs = self.list_runs()
            if not runs:
                raise StateError(f"no runs under {self.runs} yet; start one with `rlhf run` or `rlhf demo`")
            return runs[0]
        path = self.run_dir(run_id) / RUN_FILE
        if not path.is_file():
            known = [r.run_id for r in self.list_runs()]
            listing = ", ".join(known[:20]) + (f" (and {len(known) - 20} more)" if len(known) > 20 else "")
            raise StateError(f"no run {run_id!r} under {self.runs}; "
                             + (f"existing runs (newest first): {listing}" if known else "there are no runs yet"))
        return self._read(path)

    def _read(self, path: Path) -> RunRecord:
        try:
            return RunRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, TypeError) as err:
            raise StateError(f"{path} is not a valid run record ({err}); delete {path.parent} "
                             "if the run is not needed") from err
