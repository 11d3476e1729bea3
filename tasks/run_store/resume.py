"""Resume state: what a later stage continues from (a PPO iteration's last checkpoint, optimizer state included),
published beside its artifact (``resume/<stage>/<key>``) and prunable without touching the immutable artifact.

An artifact names the one it continues in its record's inputs (e.g. ``previous``), so the chain of iterations is
known from the records alone. :func:`prune_resume_states` keeps the resume state of the newest ``keep`` artifacts
of a chain and deletes the older ones, leaving ``<key>.pruned.json`` (what pruned it) in their place, so that a
later consumer of a pruned state refuses in one line (:func:`resume_state`) instead of starting fresh.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from tasks.run_store.artifacts import Artifact, ArtifactError, read_artifact
from tasks.run_store.layout import Layout
from tasks.run_store.locks import now_iso

log = logging.getLogger(__name__)

PRUNING = ".pruning"
"""Suffix of a resume state being deleted (renamed first, so no reader ever sees half of one)."""


class ResumeStateError(LookupError):
    """The resume state of an artifact is gone (pruned, or deleted by hand); the message says how to get it back."""


def resume_state(layout: Layout, artifact: Artifact, relative: str, remedy: str) -> Path:
    """The folder ``relative`` of ``artifact``'s resume state; ResumeStateError naming what pruned it and
    ``remedy`` (how to get it back) when it is gone."""
    path = layout.resume_dir(artifact.stage, artifact.key) / relative
    if path.exists():
        return path
    marker = layout.pruned_marker(artifact.stage, artifact.key)
    if marker.is_file():
        info = json.loads(marker.read_text(encoding="utf-8"))
        raise ResumeStateError(
            f"cannot continue from {artifact.identity()}: its resume state (optimizer state, RNGs) was pruned on "
            f"{info['at']} after {info['pruned_by']} was published ({info['setting']}={info['keep']} keeps the "
            f"newest {info['keep']}); {remedy}")
    raise ResumeStateError(f"cannot continue from {artifact.identity()}: its resume state {path} is missing "
                           f"(deleted by hand?); {remedy}")


def chain(layout: Layout, newest: Artifact, link: str) -> list[Artifact]:
    """``newest`` and the artifacts it continues, following input ``link`` of each record; newest first."""
    found = [newest]
    while isinstance(identity := found[-1].record.inputs.get(link), str):
        stage, _, key = identity.partition("/")
        try:
            earlier = read_artifact(layout, stage, key)
        except ArtifactError as error:
            log.warning("resume-state retention stops at %s: %s", identity, error)
            break
        if earlier is None:
            break
        found.append(earlier)
    return found


def prune_resume_states(layout: Layout, newest: Artifact, keep: int, link: str, setting: str) -> list[str]:
    """Delete the resume state of every artifact of ``newest``'s chain (:func:`chain`) but the newest ``keep``;
    returns the identities pruned now. Idempotent (a retried or cached publication prunes nothing more)."""
    if keep < 1:
        raise ValueError(f"{setting} must be >= 1 (got {keep}): the next stage continues from the newest state")
    pruned = []
    for artifact in chain(layout, newest, link)[keep:]:
        folder = layout.resume_dir(artifact.stage, artifact.key)
        doomed = folder.with_name(folder.name + PRUNING)
        if folder.is_dir():
            marker = {"pruned_by": newest.identity(), "keep": keep, "setting": setting, "at": now_iso()}
            layout.pruned_marker(artifact.stage, artifact.key).write_text(json.dumps(marker) + "\n",
                                                                          encoding="utf-8")
            shutil.rmtree(doomed, ignore_errors=True)
            folder.rename(doomed)
            pruned.append(artifact.identity())
        shutil.rmtree(doomed, ignore_errors=True)  # also one a killed prune left behind
    if pruned:
        log.info("pruned the resume state of %s (%s=%d)", ", ".join(pruned), setting, keep)
    return pruned
