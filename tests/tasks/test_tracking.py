"""MLflow helpers on a temporary SQLite store: nested stage runs, batched params, registry versions and aliases."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from tasks import tracking
from tasks.state import StateDir


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    """One store for the module (creating the SQLite schema takes seconds); tests use unique names."""
    state = StateDir(tmp_path_factory.mktemp("tracking") / "state")
    previous = mlflow.get_tracking_uri()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        tracking.configure_tracking(state)
        yield state
    mlflow.set_tracking_uri(previous)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def model_dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights.txt").write_text(text)
    (path / "sub").mkdir()
    (path / "sub" / "config.json").write_text('{"v": "%s"}' % text)
    return path


def test_configure_tracking_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    previous = mlflow.get_tracking_uri()
    monkeypatch.setattr(tracking, "_state", tracking._state)  # restored afterwards for the other tests
    monkeypatch.setattr(tracking, "_own_uri", tracking._own_uri)
    other = StateDir(tmp_path / "other")
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from-env.db")
        assert tracking.configure_tracking(other, "sqlite:///from-arg.db") == "sqlite:///from-env.db"
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
        assert tracking.configure_tracking(other, "sqlite:///from-arg.db") == "sqlite:///from-arg.db"
        assert tracking.configure_tracking(other) == other.mlflow_uri == mlflow.get_tracking_uri()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from-env.db")  # set by the user after us: wins
        assert tracking.configure_tracking(other) == "sqlite:///from-env.db"
        assert tracking.configure_tracking(other) == "sqlite:///from-env.db"
        assert other.prefect.is_dir() and other.mlartifacts.is_dir()
    finally:
        mlflow.set_tracking_uri(previous)


def test_stage_run_is_nested_under_the_pipeline_run(state: StateDir) -> None:
    experiment = unique("exp")
    with tracking.pipeline_run(experiment, "demo", params={"seed": 3}, tags={"preset": "tiny"}) as parent:
        parent_id = parent.info.run_id
        with tracking.stage_run("reward-model", parent_id, params={"lr": 1e-4}) as stage:
            tracking.log_metrics({"rm/accuracy": 0.75, "rm/margin": 1.5}, step=2)
            stage_id = stage.info.run_id
    client = MlflowClient()
    child = client.get_run(stage_id)
    assert child.data.tags["mlflow.parentRunId"] == parent_id
    assert child.data.tags["stage"] == "reward-model"
    assert child.data.params == {"lr": "0.0001"}
    assert child.info.experiment_id == client.get_run(parent_id).info.experiment_id
    assert [(m.step, m.value) for m in client.get_metric_history(stage_id, "rm/accuracy")] == [(2, 0.75)]
    assert client.get_run(parent_id).data.tags["preset"] == "tiny"
    assert client.get_run(parent_id).info.status == "FINISHED"
    # Artifacts of a local store live in the state dir, not in ./mlruns of the working directory.
    assert child.info.artifact_uri.startswith(state.mlartifacts.as_uri())


def test_pipeline_run_fails_on_error_and_resumes_by_id(state: StateDir) -> None:
    experiment = unique("exp")
    with pytest.raises(RuntimeError, match="boom"), tracking.pipeline_run(experiment, "demo") as run:
        run_id = run.info.run_id
        raise RuntimeError("boom")
    client = MlflowClient()
    assert client.get_run(run_id).info.status == "FAILED"
    with tracking.pipeline_run(experiment, "demo", params={"seed": 1}, run_id=run_id) as resumed:
        assert resumed.info.run_id == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name(experiment).experiment_id])) == 1


def test_params_are_batched_truncated_and_write_once(state: StateDir) -> None:
    params = {f"section.key_{i:03d}": i for i in range(250)}
    params["long"] = "x" * 7000
    with tracking.pipeline_run(unique("exp"), "params") as run:
        sent = tracking.log_params_flat(params)
        assert len(sent) == 251
        logged = MlflowClient().get_run(run.info.run_id).data.params
        assert len(logged) == 251 and logged["section.key_249"] == "249"
        assert len(logged["long"]) == 6000 and logged["long"].endswith(tracking.TRUNCATED)
        assert tracking.log_params_flat({"section.key_001": 1, "new": "y"}) == {"new": "y"}  # same value: skipped
        with pytest.raises(ValueError, match="section.key_001"):
            tracking.log_params_flat({"section.key_001": 2})


def test_no_active_run_is_an_error_not_a_new_run(state: StateDir) -> None:
    with pytest.raises(RuntimeError, match="no active MLflow run"):
        tracking.log_metrics({"x": 1.0})


def test_register_versions_aliases_and_resolve(state: StateDir, tmp_path: Path) -> None:
    name = unique("policy")
    with tracking.pipeline_run(unique("exp"), "register") as run:
        first = tracking.register_model_dir(model_dir(tmp_path / "v1", "one"), name, run.info.run_id)
        second = tracking.register_model_dir(model_dir(tmp_path / "v2", "two"), name, run.info.run_id)
    assert (first.version, second.version) == (1, 2)
    assert first.uri == f"models:/{name}/1" and second.name == name
    assert tracking.get_alias_version(name, "candidate") == 2  # the alias moved to the newest version
    assert tracking.get_alias_version(name, "champion") is None
    tracking.set_alias(name, "champion", 1)
    assert tracking.get_alias_version(name, "champion") == 1

    champion = Path(tracking.resolve_model_uri(f"models:/{name}@champion"))
    assert champion.is_dir() and state.cache in champion.parents
    assert (champion / "weights.txt").read_text() == "one"
    assert (champion / "sub" / "config.json").read_text() == '{"v": "one"}'
    latest = Path(tracking.resolve_model_uri(f"models:/{name}/2"))
    assert (latest / "weights.txt").read_text() == "two"
    assert tracking.resolve_model_uri(f"models:/{name}/1") == str(champion)  # cached copy reused


def test_resolve_passes_local_paths_through_and_rejects_bad_uris(state: StateDir, tmp_path: Path) -> None:
    assert tracking.resolve_model_uri(str(tmp_path)) == str(tmp_path)
    assert tracking.resolve_model_uri("gpt2") == "gpt2"
    with pytest.raises(ValueError, match="no alias"):
        tracking.resolve_model_uri(f"models:/{unique('missing')}@champion")
    with pytest.raises(ValueError, match="models:/<name>/<version>"):
        tracking.resolve_model_uri("models:/a/b/c")


def test_register_refuses_to_overwrite_an_artifact_path(state: StateDir, tmp_path: Path) -> None:
    name = unique("rm")
    with tracking.pipeline_run(unique("exp"), "overwrite") as run:
        tracking.register_model_dir(model_dir(tmp_path / "a", "a"), name, run.info.run_id, artifact_path="rm")
        with pytest.raises(ValueError, match="already has artifacts"):
            tracking.register_model_dir(model_dir(tmp_path / "b", "b"), name, run.info.run_id, artifact_path="rm")
    with pytest.raises(FileNotFoundError):
        tracking.register_model_dir(tmp_path / "nothing", name, run.info.run_id)
