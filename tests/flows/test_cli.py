"""`rlhf run`, `rlhf runs`, `rlhf stage` and `rlhf resume` from the command line (in process), on the tiny preset."""

from __future__ import annotations

import json

from flows.cli import main
from tasks.run_store import RunStore


def test_run_then_list_then_recompute_one_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "\nsft " in out and "\nfinal " in out and "mlflow ui --backend-store-uri" in out
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    summary = json.loads(store.summary_file(record.run_id).read_text())
    assert summary["run_id"] == record.run_id and summary["seconds"] > 0

    assert main(["runs", "--state-dir", state_dir]) == 0
    listing = capsys.readouterr().out
    assert record.run_id in listing and "completed" in listing

    assert main(["stage", "heldout-eval", "--run", "latest", "--state-dir", state_dir]) == 0
    after = store.load_run(record.run_id)
    changed = {label for label, entry in after.stages.items() if entry.key != record.stages[label].key}
    assert changed == {"heldout-eval-1"} and after.reruns == {"heldout-eval": 1}
    assert store.artifact("heldout-eval", after.stages["heldout-eval-1"].key).record.produced_by == record.run_id


def test_resume_can_amend_the_config_and_records_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1",
                 "refresh.enabled=false"]) == 0
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    # One more iteration on a finished run: the first one is reused, the second continues from it.
    assert main(["resume", record.run_id, "--state-dir", state_dir, "--set", "ppo.iterations=2"]) == 0
    after = store.load_run(record.run_id)
    assert after.amendments[0]["overrides"] == ["ppo.iterations=2"]
    assert after.stages["ppo-iteration-1"].key == record.stages["ppo-iteration-1"].key
    assert after.stages["ppo-iteration-2"].status == "completed"
    assert (store.config_file(record.run_id).parent / "config.1.yaml").is_file()
    assert "iterations: 2" in store.config_file(record.run_id).read_text()


def test_bad_override_and_stage_names_are_one_clear_line(tmp_path, capsys):
    assert main(["run", "--preset", "tiny", "--state-dir", str(tmp_path), "ppo.ppo.clip_rang=0.3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown setting 'ppo.ppo'" in err[0]
    assert main(["stage", "ppo-iteration-0", "--run", "latest", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown stage 'ppo-iteration-0'" in err[0]
    assert main(["resume", "nope", "--state-dir", str(tmp_path)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
