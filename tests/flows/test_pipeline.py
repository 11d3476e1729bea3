"""The whole pipeline on the tiny preset: artifacts, registry, aliases, retries and reused stages."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from mlflow import MlflowClient

import tasks.tracking
from flows.pipeline import rlhf_pipeline
from tasks.tracking.registry import get_alias_version
from tests.flows.conftest import new_tiny_run

STAGES = ["data-prep", "sft", "reward-model", "best-of-n", "ppo-iteration-1", "heldout-eval-1", "rm-refresh-1",
          "ppo-iteration-2", "heldout-eval-2"]


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

    assert calls[1] == calls[2] == "rlhf-tiny-reward-model"  # retried after the failure
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
    policy = sorted(client.search_model_versions("name='rlhf-tiny-policy'"), key=lambda v: int(v.version))
    assert [int(v.version) for v in policy] == [1, 2, 3]
    assert [v.tags["rlhf.stage"] for v in policy] == ["sft", "ppo-iteration-1", "ppo-iteration-2"]
    assert {v.tags["rlhf.run_id"] for v in policy} == {record.run_id}
    assert policy[2].tags["rlhf.artifact_key"] == f"ppo-iteration/{done.stages['ppo-iteration-2'].key}"
    assert get_alias_version("rlhf-tiny-policy", "candidate") == 3
    # The refresh after iteration 1 registered proxy v2; champion moved only if it was at least as accurate,
    # and iteration 2 trained against whichever the refresh chose.
    assert get_alias_version("rlhf-tiny-reward-model", "candidate") == 2
    (refresh,) = summary["refreshes"]
    assert get_alias_version("rlhf-tiny-reward-model", "champion") == (2 if refresh["promoted"] else 1)
    ppo2 = store.artifact("ppo-iteration", done.stages["ppo-iteration-2"].key)
    expected_rm = (f"rm-refresh/{done.stages['rm-refresh-1'].key}/reward_model" if refresh["promoted"]
                   else f"reward-model/{done.stages['reward-model'].key}/proxy")
    assert ppo2.record.inputs["reward"] == expected_rm
    assert get_alias_version("rlhf-tiny-heldout-reward-model", "candidate") == 1
    champion = get_alias_version("rlhf-tiny-policy", "champion")
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
    # The parent is what runs are compared by: headline results per iteration, what the run changed, lineage.
    parent = client.get_run(summary["mlflow_run_id"])
    final = json.loads(evaluation.path(evaluation.result["metrics_file"]).read_text())["metrics"]
    for key in ("eval/gold/mean", "eval/kl/mean", "eval/heldout/mean", "eval/proxy/mean", "eval/win_rate/gold"):
        assert [m.step for m in client.get_metric_history(parent.info.run_id, key)] == [1, 2], key
        assert parent.data.metrics[key] == pytest.approx(final[key]), key
    tags = parent.data.tags
    assert tags["eval.status"] == summary["status"] and tags["rlhf.preset"] == "tiny"
    assert tags["rlhf.changed"] == "none" and parent.info.run_name == f"tiny · {record.run_id.rsplit('-', 1)[1]}"
    assert len(tags["rlhf.code_version"]) == 16 and "| final |" in tags["mlflow.note.content"]
    assert {d.dataset.name for d in parent.inputs.dataset_inputs} >= {"train_pairs", "heldout_pairs", "ppo_prompts"}
    # The registered policy carries its evaluation; the tracking experiment opens on the training-runs view.
    assert policy[2].tags == client.get_model_version("rlhf-tiny-policy", "3").tags
    evaluated = client.get_model_version("rlhf-tiny-policy", "3").tags
    assert evaluated["eval.status"] == summary["status"] and float(evaluated["eval.gold"]) == pytest.approx(
        final["eval/gold/mean"], rel=1e-3)
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"

    # Prefect shows the run too: our progress lines on the flow run's log page, the summary as its artifact.
    logs, artifacts = prefect_view(done.prefect_flow_run_id)
    assert any("ppo-iteration-2: computing artifact" in line for line in logs)
    assert any(line.startswith("ppo step 4/4") for line in logs)
    (artifact,) = [a for a in artifacts if a.key == "rlhf-summary"]
    assert artifact.type == "markdown" and "| final |" in artifact.data and record.run_id in artifact.data

    # Running the finished run again reuses every stage: nothing new is trained, registered or logged.
    again = rlhf_pipeline(run_id=record.run_id, state_dir=str(store.root))
    assert store.load_run(record.run_id).stages == done.stages
    assert len(client.search_model_versions("name='rlhf-tiny-policy'")) == 3
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
    sft_versions = [v for v in client.search_model_versions("name='rlhf-tiny-policy'") if v.tags["rlhf.stage"] == "sft"]
    assert {v.tags["rlhf.run_id"] for v in sft_versions} == {first.run_id, second.run_id}
    assert len({v.source for v in sft_versions}) == 1  # the cached stage's version reuses the first one's files
    # The second run's parent says what it changed and which run each reused stage came from.
    parent = client.get_run(store.load_run(second.run_id).mlflow_run_id)
    assert parent.data.tags["rlhf.changed"] == "ppo.kl.coef=0.2 ppo.iterations=1"  # in the config's order
    assert parent.info.run_name.startswith("ppo.kl.coef=0.2 ppo.iterations=1 · tiny · ")
    assert {k: v for k, v in parent.data.tags.items() if k.startswith("rlhf.cached_from.")} == {
        f"rlhf.cached_from.{label}": first.run_id for label in ("data-prep", "sft", "reward-model", "best-of-n")}
    assert "eval/gold/mean" in parent.data.metrics


def prefect_view(flow_run_id: str) -> tuple[list[str], list]:
    """The log messages and artifacts Prefect's API has for a flow run (after the log batches are sent)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, LogFilter,
                                                LogFilterFlowRunId)
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)])), limit=200)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)])))
    return [entry.message for entry in logs], artifacts
