"""The MLflow adapter on SQLite: where tracking goes, nested stage runs, write-once params, registration that is
idempotent per (run, artifact, role), live curves replayed into a later run, and a moved state folder."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from tasks import tracking
from tasks.tracking import runs as tracking_runs
from tasks.tracking import setup as tracking_setup
from tasks.run_store import RunStore


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunStore]:
    """One state folder for the module on the session's SQLite store (tests/conftest.py); tests use unique names."""
    saved = tracking_setup._store, tracking_setup._own_uri
    store = RunStore(tmp_path_factory.mktemp("tracking") / "state").ensure()
    tracking.configure_tracking(store)
    yield store
    tracking_setup._store, tracking_setup._own_uri = saved


@pytest.fixture
def own_tracking(store: RunStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """For tests that point tracking elsewhere: the module's store, URI and the environment come back after."""
    previous = mlflow.get_tracking_uri()
    saved = tracking_setup._store, tracking_setup._own_uri
    yield monkeypatch
    mlflow.set_tracking_uri(previous)
    tracking_setup._store, tracking_setup._own_uri = saved


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def model_dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights.txt").write_text(text)
    (path / "sub").mkdir()
    (path / "sub" / "config.json").write_text('{"v": "%s"}' % text)
    return path


def lineage(run_id: str, key: str, role: str = "policy") -> dict[str, str]:
    """The tags Publication.register puts on a version."""
    return {"rlhf.run_id": run_id, "rlhf.artifact_key": key, "rlhf.role": role, "rlhf.stage": "ppo-iteration-1"}


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient().get_metric_history(run_id, key))


# --------------------------------------------------------------------------------------------- where tracking goes


def test_configure_tracking_precedence(own_tracking: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env, arg = f"sqlite:///{tmp_path}/from-env.db", f"sqlite:///{tmp_path}/from-arg.db"
    other = RunStore(tmp_path / "other").ensure()
    local = f"sqlite:///{other.layout.mlflow_db}"
    own_tracking.setenv("MLFLOW_TRACKING_URI", env)
    assert tracking.configure_tracking(other, arg) == env  # the user's variable beats the config
    own_tracking.delenv("MLFLOW_TRACKING_URI")
    assert tracking.configure_tracking(other, arg) == arg == mlflow.get_tracking_uri()
    assert tracking.configure_tracking(other) == local == mlflow.get_tracking_uri()
    assert other.layout.mlflow_db.is_file()  # the local store's tables are created at once, under the init lock
    # mlflow exported our own choice to the environment: it is not mistaken for the user's on the next call
    assert tracking.configure_tracking(other, arg) == arg
    assert tracking.configure_tracking(other) == local
    own_tracking.setenv("MLFLOW_TRACKING_URI", env)  # set by the user after us: wins, every time
    assert tracking.configure_tracking(other) == env
    assert tracking.configure_tracking(other) == env == mlflow.get_tracking_uri()


# --------------------------------------------------------------------------------------------- runs


def test_stage_run_is_nested_under_the_pipeline_run(store: RunStore) -> None:
    experiment, rlhf_run = unique("exp"), unique("run")
    with tracking.pipeline_run(experiment, rlhf_run, "demo", params={"seed": 3}, tags={"preset": "tiny"}) as parent:
        with tracking.stage_run("reward-model", parent, {"rlhf.artifact_key": "reward-model/abc"}) as stage:
            tracking.log_metrics(stage, {"rm/accuracy": 0.75, "rm/margin": 1.5}, step=2)
            tracking.log_params_flat({"lr": 1e-4}, stage)
        with tracking.stage_run("reward-model", parent, run_id=stage) as continued:  # a resumed stage
            tracking.log_metrics(continued, {"rm/accuracy": 0.8}, step=3)
    assert continued == stage
    client = MlflowClient()
    child, top = client.get_run(stage), client.get_run(parent)
    assert child.data.tags["mlflow.parentRunId"] == parent and child.info.run_name == "reward-model"
    assert (child.data.tags[tracking.STAGE_TAG], child.data.tags[tracking.KIND_TAG]) == ("reward-model", "stage")
    assert child.data.tags["rlhf.artifact_key"] == "reward-model/abc"
    assert child.data.params == {"lr": "0.0001"}
    assert child.info.experiment_id == top.info.experiment_id
    assert history(stage, "rm/accuracy") == [(2, 0.75), (3, 0.8)]
    assert (top.data.tags[tracking.RUN_ID_TAG], top.data.tags[tracking.KIND_TAG]) == (rlhf_run, "pipeline")
    assert top.data.tags["preset"] == "tiny" and top.data.params == {"seed": "3"}
    assert top.info.status == "FINISHED" and child.info.status == "FINISHED"
    assert len(client.search_runs([top.info.experiment_id])) == 2  # the continued stage run is no new run
    # Artifacts of a local store live in the state folder, not in ./mlruns of the working directory.
    assert child.info.artifact_uri.startswith(store.layout.mlartifacts.as_uri())


def test_pipeline_run_fails_on_error_and_is_found_again_by_its_rlhf_run_id(store: RunStore) -> None:
    experiment, rlhf_run = unique("exp"), unique("run")
    with pytest.raises(RuntimeError, match="boom"), tracking.pipeline_run(experiment, rlhf_run, "demo") as run_id:
        raise RuntimeError("boom")
    client = MlflowClient()
    assert client.get_run(run_id).info.status == "FAILED"
    with tracking.pipeline_run(experiment, rlhf_run, "demo", params={"seed": 1}) as resumed:
        assert resumed == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    with tracking.pipeline_run(experiment, unique("other-run"), "demo") as other:
        assert other != run_id
    assert len(client.search_runs([client.get_experiment_by_name(experiment).experiment_id])) == 2


def test_params_are_batched_truncated_and_write_once(store: RunStore) -> None:
    params = {f"section.key_{i:03d}": i for i in range(250)}  # more than one batch of 100
    params["long"] = "x" * 7000
    with tracking.pipeline_run(unique("exp"), unique("run"), "params") as run_id:
        sent = tracking.log_params_flat(params, run_id)
        assert len(sent) == 251
        logged = MlflowClient().get_run(run_id).data.params
        assert len(logged) == 251 and logged["section.key_249"] == "249"
        assert len(logged["long"]) == 6000 and logged["long"].endswith(tracking_runs.TRUNCATED)
        assert tracking.log_params_flat({"section.key_001": 1, "new": "y"}, run_id) == {"new": "y"}  # same: skipped
        with pytest.raises(ValueError, match="section.key_001: logged '1', now '2'"):
            tracking.log_params_flat({"section.key_001": 2}, run_id)
    assert MlflowClient().get_run(run_id).data.params["section.key_001"] == "1"


# --------------------------------------------------------------------------------------------- live curves


def test_stage_tracker_batches_curves_and_replay_gives_a_later_run_the_last_value_per_step(
        store: RunStore, tmp_path: Path) -> None:
    experiment, record = unique("exp"), tmp_path / "metrics.jsonl"
    with tracking.pipeline_run(experiment, unique("run"), "computes") as parent:
        with tracking.stage_run("ppo-iteration-1", parent) as stage:
            tracker = tracking.StageTracker(stage, parent, record, flush_every=3)
            tracker.log({"ppo/loss": 1.0, "ppo/kl": 0.1}, step=1, to_parent=["ppo/kl"])
            tracker.log({"ppo/loss": 0.8, "ppo/kl": 0.2}, step=2, to_parent=["ppo/kl"])
            assert history(stage, "ppo/loss") == []  # batched: nothing sent before the third call
            # the attempt died after step 2's checkpoint-less log; the retry logs step 2 again
            tracker.log({"ppo/loss": 0.7, "ppo/kl": 0.3}, step=2, to_parent=["ppo/kl"])
            tracker.flush()  # the third call queued the batch; a background thread sends it (wait for it here)
            assert history(stage, "ppo/loss") == [(1, 1.0), (2, 0.7), (2, 0.8)]  # live: both points of step 2
            tracker.log({"ppo/loss": 0.5}, step=3)
            tracker.flush()
    assert history(stage, "ppo/loss") == [(1, 1.0), (2, 0.7), (2, 0.8), (3, 0.5)]
    assert history(parent, "ppo/kl") == [(1, 0.1), (2, 0.2), (2, 0.3)]
    assert "ppo/loss" not in MlflowClient().get_run(parent).data.metrics  # only the keys asked for
    assert tracking.logged_keys(record) == {"ppo/loss", "ppo/kl"}
    assert tracking.logged_keys(tmp_path / "missing.jsonl") == set()
    # another rlhf run reuses the artifact holding the record: its own runs get the curves, last value per step
    with tracking.pipeline_run(experiment, unique("run"), "reuses") as parent2:
        with tracking.stage_run("ppo-iteration-1", parent2) as stage2:
            assert tracking.replay_metrics(record, stage2, parent2) == 3 + 2 + 2  # loss, kl, kl to the parent
    assert history(stage2, "ppo/loss") == [(1, 1.0), (2, 0.7), (3, 0.5)]
    assert history(stage2, "ppo/kl") == [(1, 0.1), (2, 0.3)]
    assert history(parent2, "ppo/kl") == [(1, 0.1), (2, 0.3)]
    assert "ppo/loss" not in MlflowClient().get_run(parent2).data.metrics
    assert tracking.replay_metrics(tmp_path / "missing.jsonl", stage2, parent2) == 0


# --------------------------------------------------------------------------------------------- registry


def test_register_versions_aliases_and_resolve(store: RunStore, tmp_path: Path) -> None:
    name, rlhf_run = unique("policy"), unique("run")
    with tracking.pipeline_run(unique("exp"), rlhf_run, "register") as run_id:
        first = tracking.register_model(model_dir(tmp_path / "v1", "one"), name, run_id,
                                        lineage(rlhf_run, "ppo-iteration/k1"), description="first")
        second = tracking.register_model(model_dir(tmp_path / "v2", "two"), name, run_id,
                                         lineage(rlhf_run, "ppo-iteration/k2"))
    assert (first.version, second.version) == (1, 2)
    assert first.uri == f"models:/{name}/1" and second.name == name
    version = MlflowClient().get_model_version(name, "1")
    assert version.tags == lineage(rlhf_run, "ppo-iteration/k1") and version.description == "first"
    assert version.run_id == run_id
    assert tracking.get_alias_version(name, "candidate") == 2  # the alias moved to the newest version
    assert tracking.get_alias_version(name, "champion") is None
    assert tracking.get_alias_version(unique("never-registered"), "champion") is None
    tracking.set_alias(name, "champion", 1)
    assert tracking.get_alias_version(name, "champion") == 1
    assert tracking.parse_model_uri(f"models:/{name}@champion") == first

    champion = Path(tracking.resolve_model_uri(f"models:/{name}@champion"))
    assert champion.is_dir() and store.layout.model_cache in champion.parents
    assert (champion / "weights.txt").read_text() == "one"
    assert (champion / "sub" / "config.json").read_text() == '{"v": "one"}'
    latest = Path(tracking.resolve_model_uri(f"models:/{name}/2"))
    assert (latest / "weights.txt").read_text() == "two"  # the second upload did not overwrite the first
    assert tracking.resolve_model_uri(f"models:/{name}/1") == str(champion)  # cached copy reused
    assert tracking.model_identity(first.uri) == f"{first.uri} {version.source}"


def test_register_is_idempotent_per_run_artifact_and_role_and_reuses_another_runs_files(
        store: RunStore, tmp_path: Path) -> None:
    name, key, experiment = unique("policy"), "ppo-iteration/0123456789abcdef0123", unique("exp")
    client = MlflowClient()
    with tracking.pipeline_run(experiment, "run-a", "first") as parent_a:
        with tracking.stage_run("ppo-iteration-1", parent_a) as stage_a:
            folder = model_dir(tmp_path / "policy", "weights")
            first = tracking.register_model(folder, name, stage_a, lineage("run-a", key))
            # a retried or resumed stage of the same run: the same version, no second upload
            assert tracking.register_model(folder, name, stage_a, lineage("run-a", key)) == first
            assert [a.path for a in client.list_artifacts(stage_a, "models")] == [f"models/{name}"]
            # another role of the same artifact is another model
            value = tracking.register_model(model_dir(tmp_path / "value", "v"), name, stage_a,
                                            lineage("run-a", key, "value"))
    assert (first.version, value.version) == (1, 2)
    # a later run that reuses the cached artifact registers its own version on the same files
    missing = tmp_path / "not-there"  # no upload happens, or registering would fail on the missing folder
    with tracking.pipeline_run(experiment, "run-b", "reuses") as parent_b:
        with tracking.stage_run("ppo-iteration-1", parent_b) as stage_b:
            reused = tracking.register_model(missing, name, stage_b, lineage("run-b", key))
            assert tracking.register_model(missing, name, stage_b, lineage("run-b", key)) == reused
    assert reused.version == 3 and client.list_artifacts(stage_b) == []
    v1, v3 = client.get_model_version(name, "1"), client.get_model_version(name, "3")
    assert v3.source == v1.source and v3.run_id == stage_b and v3.tags["rlhf.run_id"] == "run-b"
    assert tracking.get_alias_version(name, "candidate") == 3
    assert (Path(tracking.resolve_model_uri(reused.uri)) / "weights.txt").read_text() == "weights"
    with pytest.raises(FileNotFoundError, match="not a folder"):  # a new artifact needs its files
        tracking.register_model(missing, name, stage_b, lineage("run-b", "ppo-iteration/other"))


def test_resolve_passes_local_paths_through_and_rejects_bad_uris(store: RunStore, tmp_path: Path) -> None:
    assert tracking.resolve_model_uri(str(tmp_path)) == str(tmp_path)
    assert tracking.resolve_model_uri("gpt2") == "gpt2"
    with pytest.raises(ValueError, match="no alias"):
        tracking.resolve_model_uri(f"models:/{unique('missing')}@champion")
    with pytest.raises(ValueError, match="models:/<name>/<version>"):
        tracking.resolve_model_uri("models:/a/b/c")


# --------------------------------------------------------------------------------------------- a moved state folder


def _locations(db: Path) -> list[str]:
    """Every artifact location the SQLite store records (the columns rebase_local_store rewrites)."""
    with sqlite3.connect(db) as connection:
        tables = {row[0] for row in connection.execute("select name from sqlite_master where type='table'")}
        return [value for table, column in tracking_setup._LOCATION_COLUMNS if table in tables
                for (value,) in connection.execute(f"select {column} from {table}") if value]


def _local_store_with_a_run(monkeypatch: pytest.MonkeyPatch, root: Path, notes: Path) -> tuple[str, tracking.ModelRef]:
    """A state folder with MLflow on SQLite inside it: one run with a file and a registered model."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    store = RunStore(root).ensure()
    assert tracking.configure_tracking(store) == f"sqlite:///{store.layout.mlflow_db}"
    notes.write_text("kept")
    with tracking.pipeline_run("moved", "run-m", "moved") as run_id:
        tracking.log_file(run_id, notes, "files")
        ref = tracking.register_model(model_dir(root.parent / "rm", "rm"), unique("rm"), run_id,
                                      lineage("run-m", "rm/k"))
    return run_id, ref


def test_rebase_local_store_rewrites_the_locations_of_a_moved_store(own_tracking: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    run_id, _ = _local_store_with_a_run(own_tracking, old_root, tmp_path / "notes.txt")
    before = _locations(old_root / "mlflow.db")
    under_old = [v for v in before if v.startswith((f"{old_root}/", f"{old_root.as_uri()}/"))]
    assert len(under_old) >= 3  # the experiment, the run, the model version (at least)

    old_root.rename(new_root)
    client = MlflowClient(f"sqlite:///{new_root / 'mlflow.db'}")  # the moved store, not rebased yet
    with pytest.raises(MlflowException, match="Failed to download"):  # its records still point into the old folder
        client.download_artifacts(run_id, "files/notes.txt", str(tmp_path))
    assert tracking.rebase_local_store(new_root / "mlflow.db", str(old_root), str(new_root)) == len(under_old)
    after = _locations(new_root / "mlflow.db")
    assert not [v for v in after if str(old_root) in v] and len(after) == len(before)
    assert Path(client.download_artifacts(run_id, "files/notes.txt", str(tmp_path))).read_text() == "kept"
    assert tracking.rebase_local_store(new_root / "mlflow.db", str(old_root), str(new_root)) == 0  # nothing left


def test_configure_tracking_rebases_a_moved_state_folder_by_itself(own_tracking: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    run_id, ref = _local_store_with_a_run(own_tracking, tmp_path / "a", tmp_path / "notes.txt")
    (tmp_path / "a").rename(tmp_path / "b")
    moved = RunStore(tmp_path / "b").ensure()
    tracking.configure_tracking(moved)
    client = MlflowClient()
    assert client.get_run(run_id).info.artifact_uri.startswith((tmp_path / "b").as_uri())
    assert client.get_model_version_download_uri(ref.name, str(ref.version)).startswith((tmp_path / "b").as_uri())
    assert Path(client.download_artifacts(run_id, "files/notes.txt", str(tmp_path))).read_text() == "kept"
    assert (Path(tracking.resolve_model_uri(ref.uri)) / "weights.txt").read_text() == "rm"
    assert moved.layout.model_cache in Path(tracking.resolve_model_uri(ref.uri)).parents


def test_a_server_that_refuses_a_borrowed_source_gets_an_upload(store, tmp_path: Path, monkeypatch) -> None:
    """Registration reuses another run's files for the same artifact; where the server refuses that (sources
    must lie in the registering run's artifacts), the folder is uploaded instead."""
    name = unique("borrowed")
    folder = model_dir(tmp_path / "m", "weights")
    client = MlflowClient()
    with tracking.pipeline_run(unique("exp"), "r1", "r1") as first:
        one = tracking.register_model(folder, name, first, {"rlhf.run_id": "r1", "rlhf.artifact_key": "sft/k",
                                                            "rlhf.role": "policy"})
    real = MlflowClient.create_model_version
    refused: list[str] = []
    with tracking.pipeline_run(unique("exp"), "r2", "r2") as second:
        def strict(self, model_name, source, run_id=None, **kwargs):
            if run_id == second and not source.startswith(client.get_run(second).info.artifact_uri):
                refused.append(source)
                raise MlflowException("source must be in the run's artifacts", error_code=INVALID_PARAMETER_VALUE)
            return real(self, model_name, source, run_id=run_id, **kwargs)

        monkeypatch.setattr(MlflowClient, "create_model_version", strict)
        two = tracking.register_model(folder, name, second, {"rlhf.run_id": "r2", "rlhf.artifact_key": "sft/k",
                                                             "rlhf.role": "policy"})
    assert refused and (one.version, two.version) == (1, 2)
    assert client.get_model_version(name, "2").source.startswith(client.get_run(second).info.artifact_uri)
