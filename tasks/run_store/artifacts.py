"""Stage artifacts: a folder of outputs plus ``record.json`` (what made it and what it holds), published once.

A stage computes into a staging folder of its key's work folder while it holds the key's claim (one writer per
key, across runs and processes), then :meth:`Claim.publish` writes the record with a checksum of every file and
renames the folder to ``artifacts/<stage>/<key>``: readers see nothing or the whole artifact, and a published
artifact never changes. The record is JSON; nothing here ever unpickles anything.

A stage may also leave resume state (what a later stage continues from, e.g. a PPO iteration's optimizer state) in
:attr:`Claim.resume_staging`; it is published beside the artifact (``resume/<stage>/<key>``), outside its checksums,
so that it can be pruned (:meth:`tasks.run_store.RunStore.prune_resume_states`) while the artifact stays whole.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.run_store.keys import canonical, code_version, sha256_file
from tasks.run_store.layout import CLAIM_LOCK, RECORD_FILE, RESUME_STAGING, STAGING, Layout
from tasks.run_store.locks import FileLock, LockBusy, now_iso

log = logging.getLogger(__name__)

RECORD_FORMAT = 1


class ArtifactError(RuntimeError):
    """An artifact record that cannot be read; the message names the file and what to do."""


@dataclass(frozen=True)
class ArtifactRecord:
    """``record.json`` of a published artifact."""

    stage: str
    """Stage that wrote it (e.g. 'ppo-iteration')."""
    key: str
    """Its key: digest of the stage's config slice, input identities and code version."""
    produced_by: str
    """The run that computed it (other runs reuse it as a cached stage)."""
    created: str
    """UTC ISO time of publication."""
    code_version: str
    """Digest of rlhf_core + tasks when it was computed."""
    config: dict[str, Any]
    """The canonical config slice the stage was given."""
    inputs: dict[str, Any]
    """Identities of its inputs: 'stage/key' of artifacts, content digests of outside files."""
    result: dict[str, Any]
    """The stage's JSON result record; paths in it are relative to the artifact folder."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Relative path -> {'size', 'sha256'} of every file in the artifact but this record."""
    format: int = RECORD_FORMAT
    """Record layout version."""


@dataclass(frozen=True)
class Artifact:
    """A published artifact: where it is and its record. Its identity (for keys) is ``stage/key``."""

    stage: str
    key: str
    folder: Path
    record: ArtifactRecord

    def identity(self) -> str:
        return f"{self.stage}/{self.key}"

    @property
    def result(self) -> dict[str, Any]:
        return self.record.result

    def path(self, relative: str) -> Path:
        """Absolute path of a file or folder of this artifact (``relative`` as the result record gives it)."""
        target = (self.folder / relative).resolve()
        if not target.is_relative_to(self.folder.resolve()):
            raise ArtifactError(f"{relative!r} points outside artifact {self.identity()}")
        return target

    def part(self, relative: str) -> ArtifactPart:
        """One file or folder of this artifact as an input of its own (e.g. the proxy RM of reward-model)."""
        return ArtifactPart(self, relative)


@dataclass(frozen=True)
class ArtifactPart:
    """A file or folder inside an artifact, as an input: identity ``stage/key/relative``."""

    artifact: Artifact
    relative: str

    def identity(self) -> str:
        return f"{self.artifact.identity()}/{self.relative}"

    @property
    def path(self) -> Path:
        return self.artifact.path(self.relative)


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {'size', 'sha256'}} of every file under ``folder`` except the record."""
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != RECORD_FILE}


def read_artifact(layout: Layout, stage: str, key: str) -> Artifact | None:
    """The published artifact of ``stage``/``key``, or None when there is none."""
    folder = layout.artifact_dir(stage, key)
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = ArtifactRecord(**data)
    except (ValueError, TypeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path} is not a valid artifact record ({type(err).__name__}: {err}); delete {folder} "
                            "to recompute that stage") from err
    if (record.stage, record.key) != (stage, key):
        raise ArtifactError(f"{path} says it is {record.stage}/{record.key}, but it sits at {stage}/{key}; delete "
                            f"{folder} to recompute that stage")
    missing = [name for name in record.files if not (folder / name).is_file()]
    if missing:
        raise ArtifactError(f"artifact {stage}/{key} lacks {len(missing)} of its files (first: {missing[0]}); "
                            f"delete {folder} to recompute that stage")
    return Artifact(stage, key, folder, record)


class Claim:
    """The right to compute one key: its work folder (kept across crashes) and a staging folder to publish."""

    def __init__(self, layout: Layout, stage: str, key: str, run_id: str) -> None:
        self.layout, self.stage, self.key, self.run_id = layout, stage, key, run_id
        self.work = layout.work_dir(stage, key)
        self.lock = FileLock(self.work / CLAIM_LOCK, f"run {run_id} computing {stage}/{key}")

    @property
    def staging(self) -> Path:
        """Where the stage writes the artifact's files (empty at the start of each attempt)."""
        return self.work / STAGING

    @property
    def resume_staging(self) -> Path:
        """Where the stage writes its resume state, if it has any (published beside the artifact, not in it)."""
        return self.work / RESUME_STAGING

    def acquire(self) -> Claim:
        try:
            self.lock.acquire()
        except LockBusy as busy:
            who = busy.holder.describe() if busy.holder else "another process"
            log.info("%s/%s is being computed by %s; waiting for it", self.stage, self.key, who)
            self.lock.acquire(blocking=True)
        shutil.rmtree(self.staging, ignore_errors=True)  # a half-written artifact of a killed attempt
        shutil.rmtree(self.resume_staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        return self

    def release(self) -> None:
        self.lock.release()

    def publish(self, result: Mapping[str, Any], config: Any, inputs: Mapping[str, Any],
                code: str | None = None) -> Artifact:
        """Write the record into the staging folder and rename it into ``artifacts/``; clear the work folder.
        ``code``: the code version in the artifact's key (default: the packages' whole)."""
        record = ArtifactRecord(stage=self.stage, key=self.key, produced_by=self.run_id, created=now_iso(),
                                code_version=code or code_version(), config=canonical(config),
                                inputs=canonical(dict(inputs)), result=json.loads(json.dumps(dict(result))),
                                files=manifest(self.staging))
        (self.staging / RECORD_FILE).write_text(json.dumps(asdict(record), indent=1, sort_keys=True) + "\n",
                                                encoding="utf-8")
        self._publish_resume_state()  # first: a published artifact always had its resume state published
        target = self.layout.artifact_dir(self.stage, self.key)
        target.parent.mkdir(parents=True, exist_ok=True)
        self.staging.rename(target)  # atomic; fails if the key was published meanwhile (it cannot: we hold it)
        for child in self.work.iterdir():  # checkpoints and scratch of this key are done with
            if child.name != CLAIM_LOCK:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        return Artifact(self.stage, self.key, target, record)

    def _publish_resume_state(self) -> None:
        if not self.resume_staging.is_dir():
            return
        target = self.layout.resume_dir(self.stage, self.key)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)  # left by an attempt killed between these two renames
        self.layout.pruned_marker(self.stage, self.key).unlink(missing_ok=True)
        self.resume_staging.rename(target)
