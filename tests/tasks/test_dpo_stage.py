"""The dpo stage on the tiny preset: the SFT policy learns the demo task's reward-model training pairs, the artifact
holds a policy that reloads, MLflow has its curves, params and registered version, a second run reuses the
artifact, and `rlhf stage dpo` (a rerun number) computes it again."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM

import tasks.dpo
from flows.commands import _refuse_other_method
from rlhf_core.training.guards import NonFiniteError
from tasks import data_prep, dpo, sft
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.run_store import Artifact
from tasks.typed_yaml import dump_config_text
from tests.stage_harness import StageHarness


def tiny_config(*extra: str) -> PipelineConfig:
    return load_config(None, "tiny", ["device=cpu", "method=dpo", *extra])


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageHarness]:
    harness = StageHarness(tmp_path_factory.mktemp("dpo") / "state")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def inputs(harness: StageHarness) -> dpo.Inputs:
    """The real data-prep and sft stages of the tiny preset (demo task, tiny GPT)."""
    config = tiny_config()
    data = harness.run(data_prep, "data-prep", data_prep.Config.of(config), data_prep.Inputs())
    trained = harness.run(sft, "sft", sft.Config.of(config), sft.Inputs(data))
    return dpo.Inputs(data, sft.model_input(trained))


@pytest.fixture(scope="module")
def trained(harness: StageHarness, inputs: dpo.Inputs) -> Artifact:
    return harness.run(dpo, "dpo", dpo.Config.of(tiny_config()), inputs)


def test_dpo_learns_the_training_pairs_and_writes_a_policy_that_reloads(trained: Artifact, inputs: dpo.Inputs) -> None:
    result = dpo.STAGE.result(trained)
    m = result.metrics
    n_train = result.counts["n_train_pairs"]
    assert result.steps_done == m["dpo/steps"] == math.ceil(n_train / 16)  # one epoch of 16-pair batches
    # Before the first step the policy is its reference: every implicit reward is 0, so accuracy is exactly 0.5.
    assert m["dpo/eval_initial/rewards/accuracy"] == 0.5 and m["dpo/eval_initial/loss"] == pytest.approx(math.log(2))
    assert m["dpo/train_eval/rewards/accuracy"] > 0.6  # it learned the training pairs
    assert m["dpo/train_eval/loss"] < math.log(2) and m["dpo/train_eval/rewards/margin"] > 0
    assert m["dpo/eval/rewards/accuracy"] > 0.5  # and it carries over to the held-out pairs
    policy = AutoModelForCausalLM.from_pretrained(dpo.model_input(trained).path)
    start = AutoModelForCausalLM.from_pretrained(inputs.reference.path)
    moved = max(float((a - b).detach().abs().max()) for a, b in zip(policy.parameters(), start.parameters()))
    assert moved > 1e-4
    assert trained.path(result.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mlflow_has_the_curves_params_and_a_registered_policy(harness: StageHarness, trained: Artifact) -> None:
    result = dpo.STAGE.result(trained)
    run = harness.mlflow_run("dpo")
    client = MlflowClient()
    losses = client.get_metric_history(run.info.run_id, "dpo/loss")
    assert [p.step for p in losses] == list(range(1, result.steps_done + 1))
    assert [p.step for p in client.get_metric_history(run.info.run_id, "dpo/eval/rewards/accuracy")] == [
        0, result.steps_done]
    for key in ("dpo/train_eval/rewards/accuracy", "dpo/eval_initial/rewards/accuracy", "dpo/seconds"):
        assert run.data.metrics[key] == pytest.approx(result.metrics[key]), key
    assert run.data.params["dpo.beta"] == "0.1" and run.data.params["dpo.loss"] == "sigmoid"
    assert run.data.params["inputs.n_train_pairs"] == str(result.counts["n_train_pairs"])
    parent = client.get_metric_history(harness.parent_run_id, "dpo/rewards/accuracy")
    assert len(parent) == result.steps_done  # the compare page of the pipeline runs shows the curve too
    uri = harness.active.stage("dpo").models["policy"]
    (version,) = [v for v in client.search_model_versions(f"name='{harness.names.policy_model}'")
                  if f"models:/{v.name}/{v.version}" == uri]
    assert version.tags["rlhf.stage"] == "dpo" and version.tags["rlhf.role"] == "policy"
    assert version.tags["rlhf.artifact_key"] == trained.identity()


def test_a_second_run_reuses_the_artifact_and_a_rerun_number_computes_it_again(
        harness: StageHarness, trained: Artifact, inputs: dpo.Inputs, monkeypatch: pytest.MonkeyPatch) -> None:
    other = StageHarness(harness.store.root, names=harness.names)
    try:
        monkeypatch.setattr(tasks.dpo, "train_dpo", _never)
        again = other.run(dpo, "dpo", dpo.Config.of(tiny_config()), inputs)
        assert again.identity() == trained.identity() and again.record.produced_by == harness.run_id
        assert other.active.stage("dpo").cached_from == harness.run_id
        monkeypatch.undo()
        # `rlhf stage dpo --run ID` counts a rerun of the label: the key changes and the stage computes again.
        other.active.record.reruns["dpo"] = 1
        rerun = other.run(dpo, "dpo", dpo.Config.of(tiny_config()), inputs)
        assert rerun.key != trained.key and rerun.record.produced_by == other.run_id
    finally:
        other.close()


def test_a_diverging_run_stops_before_the_step_and_publishes_nothing(harness: StageHarness,
                                                                       inputs: dpo.Inputs) -> None:
    cfg = dpo.Config.of(tiny_config("dpo.learning_rate=1e30", "dpo.max_grad_norm=inf"))
    with pytest.raises(NonFiniteError, match=r"DPO step \d+: (DPO loss|gradient norm.*) is (nan|inf).*stopped before"):
        harness.run(dpo, "dpo-diverging", cfg, inputs)
    entry = harness.active.stage("dpo-diverging")
    assert entry.status == "failed" and not entry.models
    assert harness.store.artifact(dpo.NAME, entry.key) is None


def test_changing_a_dpo_setting_changes_only_its_key(inputs: dpo.Inputs) -> None:
    from tasks.run_store import stage_key
    from tasks.stage import shallow_fields

    def key(*extra: str) -> str:
        return stage_key(dpo.NAME, dpo.Config.of(tiny_config(*extra)), shallow_fields(inputs))

    assert key() == key("ppo.kl.coef=0.2", "method=ppo") != key("dpo.beta=0.2") != key("dpo.loss=ipo")


def test_rlhf_stage_dpo_is_refused_on_a_ppo_run(harness: StageHarness) -> None:
    config = load_config(None, "tiny", [])
    record = harness.store.create_run(config.name, dump_config_text(config), preset="tiny")
    with pytest.raises(ConfigError, match=rf"run {record.run_id} trains with method=ppo, which has no dpo stage"):
        _refuse_other_method(harness.store, record.run_id, "dpo")
    _refuse_other_method(harness.store, record.run_id, "ppo-iteration-2")  # its own stages are fine


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a cached stage must not train")
