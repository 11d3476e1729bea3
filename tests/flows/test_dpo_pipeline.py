"""`method=dpo` end to end on the tiny preset, from the command line: the dpo stage replaces the PPO loop, its policy
gets the same heldout-eval (registry tags, best-of-n baseline, headline metrics), and `rlhf stage dpo` recomputes
it alone."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from flows.cli import main
from tasks.run_store import RunStore


def test_a_dpo_run_evaluates_its_policy_like_a_ppo_iteration_and_reruns_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "method=dpo"]) == 0
    out = capsys.readouterr().out
    assert "\nfinal policy: dpo, 11 steps; implicit-reward accuracy on held-out pairs 0.500 -> " in out
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    assert list(record.stages) == ["data-prep", "sft", "reward-model", "best-of-n", "dpo", "heldout-eval-1"]
    summary = json.loads(store.summary_file(record.run_id).read_text())
    assert summary["method"] == "dpo" and summary["dpo"]["dpo/steps"] == 11
    assert summary["best_of_n"] and summary["policies"]["final"]["kl"] > 0
    evaluation = store.artifact("heldout-eval", record.stages["heldout-eval-1"].key)
    assert evaluation.record.inputs["policy"] == f"dpo/{record.stages['dpo'].key}/policy"
    client = MlflowClient()
    versions = sorted(client.search_model_versions("name='rlhf-tiny-policy'"), key=lambda v: int(v.version))
    assert [v.tags["rlhf.stage"] for v in versions] == ["sft", "dpo"]
    assert versions[1].tags["eval.status"] == summary["status"]  # heldout-eval judged the DPO version
    parent = client.get_run(record.mlflow_run_id)
    assert parent.info.run_name.startswith("method=dpo · tiny · ")
    assert [m.step for m in client.get_metric_history(record.mlflow_run_id, "eval/gold/mean")] == [1]
    assert len(client.get_metric_history(record.mlflow_run_id, "dpo/loss")) == 11

    assert main(["stage", "dpo", "--run", "latest", "--state-dir", state_dir]) == 0
    after = store.load_run(record.run_id)
    changed = {label for label, entry in after.stages.items() if entry.key != record.stages[label].key}
    assert changed == {"dpo", "heldout-eval-1"} and after.reruns == {"dpo": 1}
    assert main(["stage", "ppo-iteration-1", "--run", "latest", "--state-dir", state_dir]) == 2
    assert "trains with method=dpo, which has no ppo-iteration stage" in capsys.readouterr().err
