"""Run stages in tests exactly as the flow does: a run store under tmp_path, a held run, MLflow on SQLite.

    harness = StageHarness(tmp_path / "state")
    data = harness.artifact("data-prep", {"train_pairs.parquet": path, ...}, result={...})   # a hand-made input
    art = harness.run(reward_model, "reward-model", cfg, reward_model.Inputs(data, sft))      # the real runner
    harness.close()
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from mlflow import MlflowClient

from tasks.config import TrackingSection
from tasks.run_store import Artifact, RunStore
from tasks.runtime import ModelInput
from tasks.stage import Publication, RunContext, run_stage
from tasks.tracking.runs import pipeline_run, stage_run
from tasks.tracking.setup import configure_tracking


class StageHarness:
    """One rlhf run in a fresh state folder, held for the harness's lifetime."""

    def __init__(self, root: Path, names: TrackingSection | None = None, experiment: str | None = None) -> None:
        self.store = RunStore(root).ensure()
        configure_tracking(self.store)
        self.names = names or unique_names()
        record = self.store.create_run("test", "name: test\n")
        self._hold = self.store.hold(record.run_id, "tests")
        self.active = self._hold.__enter__()
        with pipeline_run(experiment or f"tests-{uuid.uuid4().hex[:8]}", record.run_id, "test") as parent:
            self.parent_run_id = parent
        self.run_context = RunContext(self.store, self.active, self.parent_run_id, self.names)

    @property
    def run_id(self) -> str:
        return self.active.run_id

    def run(self, stage: ModuleType, label: str, cfg: Any, inputs: Any) -> Artifact:
        """``stage.STAGE`` through the runner (key, claim, publish, MLflow) as a flow would run it."""
        return run_stage(stage.STAGE, label, cfg, inputs, self.run_context)

    def artifact(self, stage: str, files: Mapping[str, str | Path], result: Mapping[str, Any],
                 key: str | None = None) -> Artifact:
        """Publish a hand-made artifact (files copied in under the given relative names) to feed a stage."""
        key = key or uuid.uuid4().hex[:20]
        with self.store.claim(stage, key, self.run_id) as claim:
            for relative, source in files.items():
                target = claim.staging / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if Path(source).is_dir() else shutil.copyfile)(source, target)
            return claim.publish(dict(result), {"hand-made": key}, {})

    def model(self, stage: str, folder: str | Path) -> ModelInput:
        """A model folder as a stage input (inside a hand-made artifact)."""
        return ModelInput(self.artifact(stage, {"model": folder}, {"model": "model"}), "model")

    def published(self, label: str, artifact: Artifact, models: Mapping[str, tuple[str, str]]) -> dict[str, str]:
        """Record ``artifact`` as stage ``label`` of this run, its models registered as that stage's ``publish``
        would (role -> (registered name, folder in the artifact)), so that a later stage's
        ``Publication.registered_input`` finds them. Returns role -> ``models:/`` URI."""
        self.active.stage_started(label, artifact.stage, artifact.key)
        with stage_run(label, self.parent_run_id) as mlflow_id:
            publication = Publication(self.run_context, label, artifact, mlflow_id, None)
            for role, (name, folder) in models.items():
                publication.register(role, name, folder)
        self.active.stage_update(label, status="completed", mlflow_run_id=mlflow_id, models=dict(publication.models))
        return dict(publication.models)

    def mlflow_run(self, label: str) -> Any:
        """The stage's MLflow run in this rlhf run."""
        entry = self.active.stage(label)
        assert entry is not None and entry.mlflow_run_id, f"no MLflow run for {label}"
        return MlflowClient().get_run(entry.mlflow_run_id)

    def close(self) -> None:
        self._hold.__exit__(None, None, None)


def unique_names(prefix: str = "t") -> TrackingSection:
    """Registered-model names no other test uses (the registry is shared by the test session)."""
    tag = uuid.uuid4().hex[:8]
    return TrackingSection(experiment=f"{prefix}-{tag}", policy_model=f"{prefix}-policy-{tag}",
                           reward_model=f"{prefix}-rm-{tag}", heldout_reward_model=f"{prefix}-heldout-rm-{tag}")
