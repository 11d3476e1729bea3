"""Where everything lives under the state folder. The ONLY code that knows the layout: the rest of the project asks
the run store for a run's file or an artifact's folder.

    <root>/
      artifacts/<stage>/<key>/      published stage outputs: record.json + files; immutable once published
      resume/<stage>/<key>/         resume state published with an artifact (a PPO iteration's last checkpoint:
                                    optimizer, RNGs) for the stage that continues it; not part of the artifact,
                                    so it can be pruned (then ``<key>.pruned.json`` says by what) without
                                    breaking the artifact's checksums
      work/<stage>/<key>/           unfinished work of one key: claim.lock, out/ (the artifact being written),
                                    checkpoints a killed stage resumes from, resume/ (the resume state being
                                    written)
      runs/<run_id>/                one run: run.json (the record), config.yaml, summary.json, run.log, lock
      sweeps/<sweep_id>/            one sweep (``rlhf sweep``): sweep.json (the record: grid, seeds, its runs), lock,
                                    its report (sweep_report.md / .json) and plot
      cache/models/                 downloads of models:/ URIs given as inputs
      mlflow.db, mlartifacts/       MLflow's SQLite store and artifact root (when no tracking server is set)
      prefect/                      PREFECT_HOME of Prefect's temporary local server
      state.json                    the folder's format version and where it last was (to notice a move)

Every path a record stores is relative to ``<root>``, so the folder can be moved or copied as a whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FORMAT_VERSION = 1
RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
LOG_FILE = "run.log"
RUN_LOCK = "lock"
SWEEP_FILE = "sweep.json"
RECORD_FILE = "record.json"
CLAIM_LOCK = "claim.lock"
STAGING = "out"
RESUME_STAGING = "resume"
PRUNED_SUFFIX = ".pruned.json"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class LayoutError(ValueError):
    """A run id, stage name or key that cannot name a folder (it would escape the state folder)."""


def checked_name(value: str, what: str) -> str:
    """``value`` when it is a plain folder name (letters, digits, ``._-``), else LayoutError naming ``what``."""
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise LayoutError(f"{value!r} is not a valid {what} (letters, digits, '.', '_' and '-' only)")
    return value


class Layout:
    """Paths under one state folder. Absolute from construction on, so a later chdir cannot move the state."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"Layout({str(self.root)!r})"

    # --- top level
    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def sweeps(self) -> Path:
        return self.root / "sweeps"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def model_cache(self) -> Path:
        return self.root / "cache" / "models"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlartifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def reserve(self) -> Path:
        """Disk space held back so that a full disk can still record how a run ended (RunStore._save)."""
        return self.root / "space.reserve"

    @property
    def init_lock(self) -> Path:
        return self.root / ".init.lock"

    # --- artifacts and their work folders
    def artifact_dir(self, stage: str, key: str) -> Path:
        return self.artifacts / checked_name(stage, "stage name") / checked_name(key, "artifact key")

    def work_dir(self, stage: str, key: str) -> Path:
        return self.work / checked_name(stage, "stage name") / checked_name(key, "artifact key")

    @property
    def resume(self) -> Path:
        return self.root / "resume"

    def resume_dir(self, stage: str, key: str) -> Path:
        return self.resume / checked_name(stage, "stage name") / checked_name(key, "artifact key")

    def pruned_marker(self, stage: str, key: str) -> Path:
        """Left where a resume state was pruned: what pruned it, for the refusal of a later consumer."""
        return self.resume_dir(stage, key).with_name(key + PRUNED_SUFFIX)

    # --- runs
    def run_dir(self, run_id: str) -> Path:
        return self.runs / checked_name(run_id, "run id")

    def run_file(self, run_id: str, name: str = RUN_FILE) -> Path:
        return self.run_dir(run_id) / name

    # --- sweeps
    def sweep_dir(self, sweep_id: str) -> Path:
        return self.sweeps / checked_name(sweep_id, "sweep id")

    def sweep_file(self, sweep_id: str, name: str = SWEEP_FILE) -> Path:
        return self.sweep_dir(sweep_id) / name

    def relative(self, path: str | os.PathLike[str]) -> str:
        """``path`` relative to the root (POSIX separators), for records; ValueError when it lies outside."""
        return Path(path).absolute().relative_to(self.root).as_posix()

    def resolve(self, relative: str) -> Path:
        """Inverse of :meth:`relative`."""
        return self.root / relative
