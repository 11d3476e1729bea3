"""The whole pipeline on the tiny preset: outputs, registry, aliases, retries and cached reruns."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from mlflow import MlflowClient

import tasks.reward_model
from flows.pipeline import run_pipeline
from tasks.tracking import configure_tracking, get_alias_version
from tests.flows.conftest import new_tiny_run

STAGES = ["data-prep", "sft", "reward-model", "best-of-n", "ppo-iteration-1", "heldout-eval-1", "rm-refresh-1",
          "ppo-iteration-2", "heldout-eval-2"]


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")


def test_pipeline_runs_registers_retries_and_skips_cached_stages(tmp_path, mlflow_store, monkeypatch):
    state, record = new_tiny_run(tmp_path / "state")
    configure_tracking(state)
    # The registry fails once (a transient error): the reward-model stage must be retried, not failed.
    real_register, calls = tasks.reward_model.register_model_dir, []

    def flaky_register(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise ConnectionError("registry briefly unreachable")
        return real_register(*args, **kwargs)

    monkeypatch.setattr(tasks.reward_model, "register_model_dir", flaky_register)
    summary = run_pipeline(record.config_path, record.run_id)
    monkeypatch.setattr(tasks.reward_model, "register_model_dir", real_register)

    assert calls[0] == calls[1] == "rlhf-reward-model"  # retried after the failure
    run_dir = state.run_dir(record.run_id)
    # Parquet outputs, with counts that reconcile.
    train = pd.read_parquet(run_dir / "data" / "train_pairs.parquet")
    assert {"prompt", "chosen", "rejected"} <= set(train.columns) and len(train) > 100
    counts = json.loads((run_dir / "data" / "data_prep_counts.json").read_text())
    assert counts["rows_in"] == counts["rows_accepted"] + counts["rows_quarantined"]
    samples = pd.read_parquet(run_dir / "eval" / "iter_002" / "eval_samples.parquet")
    assert len(samples) == 16 and samples["gold_policy"].notna().all()
    # Registry: SFT policy v1, one policy version per PPO iteration; aliases.
    client = MlflowClient()
    policy_versions = sorted(int(v.version) for v in client.search_model_versions("name='rlhf-policy'"))
    assert policy_versions == [1, 2, 3]
    assert get_alias_version("rlhf-policy", "candidate") == 3
    # The refresh after iteration 1 registered proxy v2; champion moved only if it was at least as accurate,
    # and iteration 2 trained against whichever the refresh returned.
    assert get_alias_version("rlhf-reward-model", "candidate") == 2
    (refresh,) = summary["refreshes"]
    assert get_alias_version("rlhf-reward-model", "champion") == (2 if refresh["promoted"] else 1)
    assert refresh["reward_model_uri"] == f"models:/rlhf-reward-model/{2 if refresh['promoted'] else 1}"
    assert get_alias_version("rlhf-heldout-reward-model", "candidate") == 1
    champion = get_alias_version("rlhf-policy", "champion")
    assert (champion == 3) == summary["promoted"]
    if summary["status"] != "ok":
        assert champion != 3
    # The summary the CLI prints and writes.
    written = json.loads((run_dir / "summary.json").read_text())
    for policy in ("sft", "final"):
        assert set(written["policies"][policy]) == {"proxy", "heldout", "gold", "kl", "length"}
    assert written["policies"]["sft"]["kl"] == 0.0
    assert state.load_run(record.run_id).status == "completed"
    # Nested MLflow runs, one per stage, under the parent.
    children = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
    finished = sorted(r.data.tags["stage"] for r in children if r.info.status == "FINISHED")
    failed = [r.data.tags["stage"] for r in children if r.info.status == "FAILED"]
    assert len(finished) == 9 and failed == ["reward-model"]  # the failed first attempt stays visible

    # Rerunning the finished run skips every stage: nothing new is trained or registered.
    again = run_pipeline(record.config_path, record.run_id)
    stages = state.load_run(record.run_id).stages
    assert [s for s in STAGES if stages[s].result == {"cached": True}] == STAGES
    assert sorted(int(v.version) for v in client.search_model_versions("name='rlhf-policy'")) == [1, 2, 3]
    assert again["policies"] == summary["policies"]


def test_a_changed_ppo_setting_reruns_only_ppo_and_eval(tmp_path, mlflow_store):
    state, first = new_tiny_run(tmp_path / "state", "ppo.iterations=1")
    configure_tracking(state)
    run_pipeline(first.config_path, first.run_id)
    _, second = new_tiny_run(tmp_path / "state", "ppo.iterations=1", "ppo.kl.coef=0.2")
    run_pipeline(second.config_path, second.run_id)
    stages = state.load_run(second.run_id).stages
    assert {name: stage.result["cached"] for name, stage in stages.items()} == {
        "data-prep": True, "sft": True, "reward-model": True, "best-of-n": True, "ppo-iteration-1": False, "heldout-eval-1": False}
