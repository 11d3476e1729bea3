"""`rlhf run`, `rlhf runs` and `rlhf stage` from the command line (in process), on the tiny preset."""

from __future__ import annotations

import json

from flows.cli import main
from tasks.state import StateDir


def test_run_then_list_then_rerun_one_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "\nsft " in out and "\nfinal " in out and "mlflow ui --backend-store-uri" in out
    (record,) = StateDir(state_dir).list_runs()
    summary = json.loads((StateDir(state_dir).run_dir(record.run_id) / "summary.json").read_text())
    assert summary["run_id"] == record.run_id and summary["seconds"] > 0

    assert main(["runs", "--state-dir", state_dir]) == 0
    listing = capsys.readouterr().out
    assert record.run_id in listing and "completed" in listing

    assert main(["stage", "heldout-eval", "--run", "latest", "--state-dir", state_dir]) == 0
    stages = StateDir(state_dir).load_run(record.run_id).stages
    assert {name: s.result["cached"] for name, s in stages.items()} == {
        "data-prep": True, "sft": True, "reward-model": True, "best-of-n": True, "ppo-iteration-1": True, "heldout-eval-1": False}


def test_bad_override_is_one_clear_line(tmp_path, capsys):
    assert main(["run", "--preset", "tiny", "--state-dir", str(tmp_path), "ppo.clip_rang=0.3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'ppo.clip_range'" in err[0]
