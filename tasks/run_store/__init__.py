"""The run store: the one owner of the state folder (layout in :mod:`tasks.run_store.layout`).

- **Artifacts** (:mod:`.artifacts`): a stage's outputs, content-addressed by a key derived from its config slice,
  its inputs and the code (:mod:`.keys`); computed under a per-key claim, published atomically, never changed.
- **Runs** (:mod:`.runs`): a JSON record per run that refers to artifacts by key. One writer per run: whoever
  holds its lock (:meth:`RunStore.hold`); the lock doubles as liveness, so a killed run is found and marked
  ``crashed``.

    store = RunStore(".rlhf_state").ensure()
    record = store.create_run("demo", config_yaml)
    with store.hold(record.run_id, "rlhf run") as run:        # RunLockedError if another process holds it
        art = store.artifact("sft", key)                       # None when not computed yet
        with store.claim("sft", key, run.run_id) as claim:     # waits while another run computes that key
            ...write into claim.staging...
            art = claim.publish(result, config_slice, inputs)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.run_store.artifacts import Artifact, ArtifactError, ArtifactPart, Claim, read_artifact
from tasks.run_store.disk import RESERVE_BYTES, DiskReserve, write_text
from tasks.run_store.holding import RunLockedError, StateError, refuse_if_held, sole_writer
from tasks.run_store.keys import LocalPath, ModelSource, code_version, stage_key
from tasks.run_store.layout import (CONFIG_FILE, FORMAT_VERSION, LOG_FILE, RUN_LOCK, SUMMARY_FILE, SWEEP_FILE,
                                   Layout, LayoutError)
from tasks.run_store.locks import FileLock, Holder, LockBusy, holder_if_alive, now_iso
from tasks.run_store.resume import ResumeStateError, prune_resume_states, resume_state
from tasks.run_store.runs import RunRecord, RunStatus, StageEntry, new_run_id
from tasks.run_store.sweeps import SweepCell, SweepRecord, SweepStatus

log = logging.getLogger(__name__)

LATEST = "latest"

__all__ = ["LATEST", "RESERVE_BYTES", "ActiveRun", "ActiveSweep", "Artifact", "ArtifactError", "ArtifactPart", "Claim",
           "LocalPath", "ModelSource", "ResumeStateError", "RunLockedError", "RunRecord", "RunStore", "StageEntry",
           "StateError", "SweepCell", "SweepRecord", "code_version", "new_run_id", "stage_key"]


class RunStore:
    """The state folder: artifacts, work folders and run records (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.layout = Layout(root)
        self.reserve = DiskReserve(self.layout.reserve, self.layout.root)
        self.moved_from: str | None = None
        """The folder's previous location when it was moved or copied since the last run (see :meth:`ensure`)."""

    @property
    def root(self) -> Path:
        return self.layout.root

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r})"

    def ensure(self) -> RunStore:
        """Create the folders; notice (``moved_from``) when the folder was moved or copied since its last use.

        A move is settled (:meth:`settle_move`) once what holds absolute paths (MLflow's local store) was rebased.
        """
        for folder in (self.layout.runs, self.layout.artifacts, self.layout.work, self.layout.resume,
                       self.layout.mlartifacts, self.layout.prefect_home):
            folder.mkdir(parents=True, exist_ok=True)
        state = self.layout.state_file
        try:
            known = json.loads(state.read_text(encoding="utf-8")) if state.is_file() else {}
        except ValueError:
            known = {}
        previous = known.get("root") if isinstance(known, dict) else None
        self.reserve.hold()
        if previous is None:
            self.settle_move()
        elif previous != str(self.root):
            self.moved_from = previous
        return self

    def settle_move(self) -> None:
        """Record the folder's current place (after a move, once MLflow's local store has been rebased)."""
        write_text(self.layout.state_file, json.dumps({"format": FORMAT_VERSION, "root": str(self.root)}) + "\n")
        self.moved_from = None

    @contextmanager
    def initializing(self) -> Iterator[None]:
        """Serialise the creation of shared databases (MLflow's, Prefect's) between processes starting together."""
        lock = FileLock(self.layout.init_lock, "initialising the state folder")
        self.layout.root.mkdir(parents=True, exist_ok=True)
        lock.acquire(blocking=True)
        try:
            yield
        finally:
            lock.release()

    # ----------------------------------------------------------------------------------------- artifacts

    def artifact(self, stage: str, key: str) -> Artifact | None:
        """The published artifact of ``stage``/``key`` or None; ArtifactError when its record is damaged."""
        return read_artifact(self.layout, stage, key)

    @contextmanager
    def claim(self, stage: str, key: str, run_id: str) -> Iterator[Claim]:
        """Hold the right to compute ``stage``/``key`` (waits while another process computes it). Check
        :meth:`artifact` again inside: the other process may have published it meanwhile."""
        claim = Claim(self.layout, stage, key, run_id).acquire()
        try:
            yield claim
        finally:
            claim.release()

    def resume_state(self, artifact: Artifact, relative: str, remedy: str) -> Path:
        """The folder ``relative`` of the resume state published with ``artifact`` (:mod:`.resume`);
        ResumeStateError in one line, naming what pruned it and ``remedy``, when it is gone."""
        return resume_state(self.layout, artifact, relative, remedy)

    def prune_resume_states(self, newest: Artifact, keep: int, link: str, setting: str) -> list[str]:
        """Keep the resume state of ``newest`` and the ``keep - 1`` artifacts before it in the chain its input
        ``link`` forms; delete the older ones (``setting`` names the retention setting in the refusal)."""
        return prune_resume_states(self.layout, newest, keep, link, setting)

    def scratch_dir(self, name: str, key: str) -> Path:
        """A work folder of its own (``work/<name>/<key>``, created) that no publication clears."""
        folder = self.layout.work_dir(name, key)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    # ----------------------------------------------------------------------------------------- runs

    def config_file(self, run_id: str) -> Path:
        """The run's resolved config (YAML), written once when the run is created."""
        return self.layout.run_file(run_id, CONFIG_FILE)

    def summary_file(self, run_id: str) -> Path:
        return self.layout.run_file(run_id, SUMMARY_FILE)

    def log_file(self, run_id: str) -> Path:
        """The run's log: every attempt's log lines and the full traceback of a failure, appended."""
        return self.layout.run_file(run_id, LOG_FILE)

    def write_summary(self, run_id: str, summary: dict) -> Path:
        """The run's ``summary.json`` (written atomically); returns its path."""
        path = self.summary_file(run_id)
        write_text(path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return path

    def create_run(self, name: str, config_yaml: str, run_id: str | None = None,
                   preset: str | None = None, sweep_id: str | None = None) -> RunRecord:
        """A new record with its resolved config: 'running', or 'pending' for a sweep's run (it starts when the sweep
        gets to it); StateError if ``run_id`` exists already."""
        record = RunRecord(run_id=run_id or new_run_id(), name=name, preset=preset, sweep_id=sweep_id,
                           status="pending" if sweep_id else "running")
        folder = self.layout.run_dir(record.run_id)
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            raise StateError(f"run {record.run_id} exists already under {self.layout.runs}") from None
        write_text(self.config_file(record.run_id), config_yaml)
        self._save(record)
        return record

    def replace_config(self, run_id: str, config_yaml: str) -> Path:
        """Amend a run's config (``rlhf resume KEY=VALUE``); the previous one is kept as ``config.<n>.yaml``."""
        current = self.config_file(run_id)
        n = 1
        while current.with_name(f"config.{n}.yaml").exists():
            n += 1
        current.rename(current.with_name(f"config.{n}.yaml"))
        write_text(current, config_yaml)
        return current

    def exists(self, run_id: str) -> bool:
        return self.layout.run_file(run_id).is_file()

    def load_run(self, run_id: str) -> RunRecord:
        """The record of ``run_id`` ('latest' = newest); StateError lists the existing ids when it is missing."""
        if run_id == LATEST:
            runs = self.list_runs()
            if not runs:
                raise StateError(f"no runs under {self.layout.runs} yet; start one with `rlhf run` or `rlhf demo`")
            return runs[0]
        try:
            path = self.layout.run_file(run_id)
        except LayoutError as err:
            raise StateError(str(err)) from None
        if not path.is_file():
            known = [r.run_id for r in self.list_runs()]
            listing = ", ".join(known[:20]) + (f" (and {len(known) - 20} more)" if len(known) > 20 else "")
            raise StateError(f"no run {run_id!r} under {self.layout.runs}; "
                             + (f"existing runs (newest first): {listing}" if known else "there are no runs yet"))
        return self._read(path)

    def list_runs(self, reconcile: bool = True) -> list[RunRecord]:
        """Every run, newest first; with ``reconcile``, runs whose process died are marked 'crashed' first."""
        if not self.layout.runs.is_dir():
            return []
        records = [self._read(p) for p in self.layout.runs.glob("*/run.json")]
        if reconcile:
            records = [self.reconcile(r) for r in records]
        return sorted(records, key=lambda r: (r.created, r.run_id), reverse=True)

    def holder(self, run_id: str) -> Holder | None:
        """The live process holding the run, or None."""
        return holder_if_alive(self.layout.run_file(run_id, RUN_LOCK))

    @contextmanager
    def hold(self, run_id: str, purpose: str) -> Iterator[ActiveRun]:
        """Be the run's only writer while inside (with a heartbeat); RunLockedError names the live holder."""
        with sole_writer(self.layout.run_file(run_id, RUN_LOCK), purpose, f"run {run_id}"):
            yield ActiveRun(self, self.load_run(run_id))

    def refuse_if_held(self, run_id: str) -> None:
        """RunLockedError naming the live holder of the run, if there is one (a check before starting work)."""
        refuse_if_held(self.layout.run_file(run_id, RUN_LOCK), f"run {run_id}")

    def end_run(self, run_id: str, status: RunStatus, error: str | None = None) -> bool:
        """Mark a run that nobody holds any more as ``status`` (Prefect's failure / crash hooks, ``rlhf runs``).

        Only a 'running' record changes, and only while no live process holds the run; True when it changed.
        """
        with self._unheld(self.layout.run_file(run_id, RUN_LOCK), f"marking run {run_id} {status}") as free:
            record = self.load_run(run_id) if free else None
            if record is None or record.status != "running":
                return False
            self._set_status(record, status, error)
            return True

    @contextmanager
    def _unheld(self, lock_path: Path, purpose: str) -> Iterator[bool]:
        """Inside: True when no live process held ``lock_path`` (this one holds it now), else False. The lock is taken
        even on a full disk (the reserve is freed for it)."""
        lock = FileLock(lock_path, purpose)
        try:
            self.reserve.with_room(lock.acquire)
        except LockBusy:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def reconcile(self, record: RunRecord) -> RunRecord:
        """A 'running' record whose process is gone becomes 'crashed' (saved); other records come back as they are."""
        if record.status == "running" and self.holder(record.run_id) is None:
            if self.end_run(record.run_id, "crashed", "the process running it stopped without a word (killed?); "
                                                      f"continue with `rlhf resume {record.run_id}`"):
                return self.load_run(record.run_id)
        return record

    # ----------------------------------------------------------------------------------------- sweeps

    def sweep_file(self, sweep_id: str, name: str = SWEEP_FILE) -> Path:
        """A file of the sweep's folder (its record by default; its report and plot beside it)."""
        return self.layout.sweep_file(sweep_id, name)

    def create_sweep(self, record: SweepRecord) -> SweepRecord:
        """Write a new sweep's record; StateError if its id exists already."""
        try:
            self.layout.sweep_dir(record.sweep_id).mkdir(parents=True)
        except FileExistsError:
            raise StateError(f"sweep {record.sweep_id} exists already under {self.layout.sweeps}") from None
        self._save_sweep(record)
        return record

    def load_sweep(self, sweep_id: str) -> SweepRecord:
        """The record of ``sweep_id`` ('latest' = newest); StateError lists the existing ids when it is missing."""
        try:
            known = sorted((p.parent.name for p in self.layout.sweeps.glob(f"*/{SWEEP_FILE}")), reverse=True)
            path = self.layout.sweep_file(known[0] if sweep_id == LATEST and known else sweep_id)
        except LayoutError as err:
            raise StateError(str(err)) from None
        if not path.is_file():
            listing = ", ".join(known[:20]) if known else "there are no sweeps yet"
            raise StateError(f"no sweep {sweep_id!r} under {self.layout.sweeps}; existing sweeps (newest first): "
                             f"{listing}")
        try:
            return SweepRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:
            raise StateError(f"{path} is not a valid sweep record ({type(err).__name__}: {err})") from err

    @contextmanager
    def hold_sweep(self, sweep_id: str, purpose: str) -> Iterator[ActiveSweep]:
        """Be the sweep's only writer while inside; RunLockedError names the live holder (a second
        ``rlhf sweep --resume`` of it)."""
        with sole_writer(self.layout.sweep_file(sweep_id, RUN_LOCK), purpose, f"sweep {sweep_id}"):
            yield ActiveSweep(self, self.load_sweep(sweep_id))

    def refuse_sweep_if_held(self, sweep_id: str) -> None:
        """RunLockedError naming the live holder of the sweep, if there is one."""
        refuse_if_held(self.layout.sweep_file(sweep_id, RUN_LOCK), f"sweep {sweep_id}")

    def end_sweep(self, sweep_id: str, status: SweepStatus, error: str | None = None) -> bool:
        """Mark a sweep nobody holds any more (its flow stopped before it could) as ``status``; True when it changed."""
        with self._unheld(self.layout.sweep_file(sweep_id, RUN_LOCK), f"marking sweep {sweep_id} {status}") as free:
            record = self.load_sweep(sweep_id) if free else None
            if record is None or record.status != "running":
                return False
            ActiveSweep(self, record).set_status(status, error)
            return True

    def _save_sweep(self, record: SweepRecord) -> None:
        self.reserve.with_room(lambda: write_text(self.layout.sweep_file(record.sweep_id), record.to_json()))

    def _set_status(self, record: RunRecord, status: RunStatus, error: str | None = None) -> None:
        """The one place a run's status is written."""
        record.status, record.error = status, error
        record.ended = None if status == "running" else now_iso()
        self._save(record)
        log.debug("run %s is %s", record.run_id, status)

    def _save(self, record: RunRecord) -> None:
        self.reserve.with_room(lambda: write_text(self.layout.run_file(record.run_id), record.to_json()))

    def _read(self, path: Path) -> RunRecord:
        try:
            return RunRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:
            raise StateError(f"{path} is not a valid run record ({type(err).__name__}: {err}); delete {path.parent} "
                             "if the run is not needed") from err


class ActiveSweep:
    """A sweep this process holds: the only writer of its record while :meth:`RunStore.hold_sweep` lasts."""

    def __init__(self, store: RunStore, record: SweepRecord) -> None:
        self.store, self.record = store, record

    def save(self) -> None:
        self.store._save_sweep(self.record)

    def set_status(self, status: SweepStatus, error: str | None = None) -> None:
        self.record.status, self.record.error = status, error
        self.record.ended = None if status == "running" else now_iso()
        self.save()


class ActiveRun:
    """A run this process holds: the only writer of its record while :meth:`RunStore.hold` lasts."""

    def __init__(self, store: RunStore, record: RunRecord) -> None:
        self.store, self.record = store, record

    @property
    def run_id(self) -> str:
        return self.record.run_id

    def save(self) -> None:
        self.store._save(self.record)

    def set_status(self, status: RunStatus, error: str | None = None) -> None:
        self.store._set_status(self.record, status, error)

    def stage(self, label: str) -> StageEntry | None:
        return self.record.stages.get(label)

    def stage_started(self, label: str, stage: str, key: str, cached_from: str | None = None) -> StageEntry:
        """Record that ``label`` now works on ``key``; an entry of the same key keeps its MLflow run and models."""
        previous = self.record.stages.get(label)
        same = previous is not None and previous.key == key
        entry = StageEntry(stage, key, "running", cached_from,
                           previous.mlflow_run_id if same else None, dict(previous.models) if same else {})
        self.record.stages[label] = entry
        self.save()
        return entry

    def stage_update(self, label: str, **changes: object) -> StageEntry:
        """Change fields of a stage entry (status, mlflow_run_id, models, error) and save."""
        entry = self.record.stages[label]
        for name, value in changes.items():
            setattr(entry, name, value)
        entry.updated = now_iso()
        self.save()
        return entry
