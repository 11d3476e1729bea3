"""The state directory: run records saved atomically, listed newest first, clear errors for missing runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.state import RunRecord, StateDir, StateError, new_run_id


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    return StateDir(tmp_path / "state").ensure()


def test_layout_is_under_one_absolute_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    state = StateDir()
    assert state.root == tmp_path / ".rlhf_state"
    for path in (state.runs, state.cache, state.mlflow_db, state.mlartifacts, state.prefect):
        assert path.parent == state.root
    assert state.mlflow_uri == f"sqlite:///{tmp_path / '.rlhf_state' / 'mlflow.db'}"
    monkeypatch.chdir("/")
    assert state.root == tmp_path / ".rlhf_state"  # a later chdir does not move it


def test_run_ids_sort_by_creation_and_are_unique() -> None:
    ids = [new_run_id() for _ in range(50)]
    assert ids == sorted(ids) and len(set(ids)) == 50


def test_record_round_trip(state: StateDir) -> None:
    record = state.new_run("demo", config_path="/x/config.yaml")
    record.mlflow_run_id = "abc123"
    record.set_stage("data-prep", "completed", {"tables": "/x/data", "pairs": 180})
    record.set_stage("sft", "failed", error="CUDA out of memory")
    record.status = "failed"
    path = state.save_run(record)
    assert path == state.run_dir(record.run_id) / "run.json"
    loaded = state.load_run(record.run_id)
    assert loaded == record
    assert loaded.stages["data-prep"].result == {"tables": "/x/data", "pairs": 180}
    assert loaded.stages["sft"].error == "CUDA out of memory"
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temp file left behind


def test_set_stage_keeps_the_earlier_result_unless_given(state: StateDir) -> None:
    record = state.new_run("demo")
    record.set_stage("reward-model", "completed", {"uri": "models:/rm/1"})
    record.set_stage("reward-model", "running")
    assert record.stages["reward-model"].result == {"uri": "models:/rm/1"}
    record.set_stage("reward-model", "completed", {"uri": "models:/rm/2"})
    assert record.stages["reward-model"].result == {"uri": "models:/rm/2"}


def test_list_runs_newest_first(state: StateDir) -> None:
    records = [RunRecord(run_id=f"run-{i}", name="demo", created=f"2025-01-0{i}T00:00:00+00:00") for i in (2, 1, 3)]
    for record in records:
        state.save_run(record)
    (state.runs / "half-started").mkdir()  # no run.json yet: skipped
    assert [r.run_id for r in state.list_runs()] == ["run-3", "run-2", "run-1"]
    assert state.load_run("latest").run_id == "run-3"


def test_missing_run_lists_existing_ids(state: StateDir) -> None:
    with pytest.raises(StateError, match="there are no runs yet"):
        state.load_run("nope")
    with pytest.raises(StateError, match="no runs"):
        state.load_run("latest")
    first, second = state.new_run("a"), state.new_run("b")
    with pytest.raises(StateError) as info:
        state.load_run("nope")
    message = str(info.value)
    assert "'nope'" in message and str(state.runs) in message
    assert message.index(second.run_id) < message.index(first.run_id)  # newest first


def test_bad_run_ids_and_corrupt_records(state: StateDir) -> None:
    with pytest.raises(StateError, match="not a run id"):
        state.run_dir("../outside")
    record = state.new_run("demo")
    (state.run_dir(record.run_id) / "run.json").write_text("{not json")
    with pytest.raises(StateError, match="not a valid run record"):
        state.load_run(record.run_id)


def test_record_file_is_plain_json(state: StateDir) -> None:
    record = state.new_run("demo")
    data = json.loads((state.run_dir(record.run_id) / "run.json").read_text())
    assert data["run_id"] == record.run_id and data["status"] == "running" and data["stages"] == {}
