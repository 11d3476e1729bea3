"""The whole pipeline on the tiny preset: artifacts, registry, aliases, retries and reused stages."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from mlflow import MlflowClient

import tasks.tracking
from flows.pipeline import rlhf_pipeline
from tasks.tracking import get_alias_version
from tests.flows.conftest import new_tiny_run

STAGES = ["data-prep", "sft", "reward-model", "best-of-n", "ppo-iteration-1", "heldout-eval-1", "rm-refresh-1",
          "ppo-iteration-2", "heldout-eval-2"]


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")


def test_pipeline_runs_registers_retries_and_reuses_finished_stages(tmp_path, mlflow_store, monkeypatch):
    store, record = new_tiny_run(tmp_path / "state")
    # The registry fails once (a transient error): the reward-model stage must be retried, not failed, and its
    # artifact (computed before the registry call) reused by the retry instead of trained again.
    real_register, calls = tasks.tracking.register_model, []

    def flaky_register(folder, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 2:  # the SFT policy went through; the proxy RM's registration fails once
            raise ConnectionError("registry briefly unreachable")
        return real_register(folder, name, *args, **kwargs)

    monkeypatch.setattr(tasks.tracking, "register_model", flaky_register)
    summary = rlhf_pipeline(run_id=record.run_id, state_dir=str(store.root))
    monkeypatch.setattr(tasks.tracking, "register_model", real_register)

    assert calls[1] == calls[2] == "rlhf-reward-model"  # retried after the failure
    done = store.load_run(record.run_id)
    assert done.status == "completed" and list(done.stages) == STAGES
    rm = store.artifact("reward-model", done.stages["reward-model"].key)
    assert rm.record.produced_by == record.run_id  # trained once: the retry found the artifact
    # Parquet outputs, with counts that reconcile.
    data = store.artifact("data-prep", done.stages["data-prep"].key)
    train = pd.read_parquet(data.path(data.result["train_pairs"]))
    assert {"prompt", "chosen", "rejected"} <= set(train.columns) and len(train) > 100
    counts = json.loads(data.path(data.result["counts"]).read_text())
    assert counts["rows_in"] == counts["rows_accepted"] + counts["rows_quarantined"]
    evaluation = store.artifact("heldout-eval", done.stages["heldout-eval-2"].key)
    samples = pd.read_parquet(evaluation.path(evaluation.result["samples"]))
    assert len(samples) == 16 and samples["gold_policy"].notna().all()
    # Registry: SFT policy v1, one policy version per PPO iteration, lineage tags, aliases.
    client = MlflowClient()
    policy = sorted(client.search_model_versions("name='rlhf-policy'"), key=lambda v: int(v.version))
    assert [int(v.version) for v in policy] == [1, 2, 3]
    assert [v.tags["rlhf.stage"] for v in policy] == ["sft", "ppo-iteration-1", "ppo-iteration-2"]
    assert {v.tags["rlhf.run_id"] for v in policy} == {record.run_id}
    assert policy[2].tags["rlhf.artifact_key"] == f"ppo-iteration/{done.stages['ppo-iteration-2'].key}"
    assert get_alias_version("rlhf-policy", "candidate") == 3
    # The refresh after iteration 1 registered proxy v2; champion moved only if it was at least as accurate,
    # and iteration 2 trained against whichever the refresh chose.
    assert get_alias_version("rlhf-reward-model", "candidate") == 2
    (refresh,) = summary["refreshes"]
    assert get_alias_version("rlhf-reward-model", "champion") == (2 if refresh["promoted"] else 1)
    ppo2 = store.artifact("ppo-iteration", done.stages["ppo-iteration-2"].key)
    expected_rm = (f"rm-refresh/{done.stages['rm-refresh-1'].key}/reward_model" if refresh["promoted"]
                   else f"reward-model/{done.stages['reward-model'].key}/proxy")
    assert ppo2.record.inputs["reward"] == expected_rm
    assert get_alias_version("rlhf-heldout-reward-model", "candidate") == 1
    champion = get_alias_version("rlhf-policy", "champion")
    assert (champion == 3) == summary["promoted"]
    # The summary the CLI prints and writes.
    written = json.loads(store.summary_file(record.run_id).read_text())
    for name in ("sft", "final"):
        assert set(written["policies"][name]) == {"proxy", "heldout", "gold", "kl", "length"}
    assert written["policies"]["sft"]["kl"] == 0.0
    assert written["artifacts"]["sft"] == {"artifact": f"sft/{done.stages['sft'].key}", "cached_from": None}
    # One nested MLflow run per stage under the parent; the retried stage continued its own run.
    children = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
    assert sorted(r.data.tags["rlhf.stage"] for r in children) == sorted(STAGES)
    assert {r.info.status for r in children} == {"FINISHED"}
    curves = client.get_metric_history(summary["mlflow_run_id"], "ppo/kl/mean")
    assert [m.step for m in curves] == [1, 2, 3, 4]  # PPO's curves also on the parent run

    # Running the finished run again reuses every stage: nothing new is trained, registered or logged.
    again = rlhf_pipeline(run_id=record.run_id, state_dir=str(store.root))
    assert store.load_run(record.run_id).stages == done.stages
    assert len(client.search_model_versions("name='rlhf-policy'")) == 3
    assert again["policies"] == summary["policies"]


def test_a_changed_ppo_setting_reruns_only_ppo_and_eval(tmp_path, mlflow_store):
    store, first = new_tiny_run(tmp_path / "state", "ppo.iterations=1")
    rlhf_pipeline(run_id=first.run_id, state_dir=str(store.root))
    _, second = new_tiny_run(tmp_path / "state", "ppo.iterations=1", "ppo.kl.coef=0.2")
    rlhf_pipeline(run_id=second.run_id, state_dir=str(store.root))
    stages = store.load_run(second.run_id).stages
    assert {label: entry.cached_from for label, entry in stages.items()} == {
        "data-prep": first.run_id, "sft": first.run_id, "reward-model": first.run_id, "best-of-n": first.run_id,
        "ppo-iteration-1": None, "heldout-eval-1": None}
    # A cached stage still shows in MLflow: its own nested run, tagged with the run that computed it.
    client = MlflowClient()
    sft_run = client.get_run(stages["sft"].mlflow_run_id)
    assert sft_run.data.tags["rlhf.cached_from"] == first.run_id and "sft/final_eval_loss" in sft_run.data.metrics
    assert [m.step for m in client.get_metric_history(stages["sft"].mlflow_run_id, "sft/train_loss")][:2] == [1, 2]
    sft_versions = [v for v in client.search_model_versions("name='rlhf-policy'") if v.tags["rlhf.stage"] == "sft"]
    assert {v.tags["rlhf.run_id"] for v in sft_versions} == {first.run_id, second.run_id}
    assert len({v.source for v in sft_versions}) == 1  # the cached stage's version reuses the first one's files
