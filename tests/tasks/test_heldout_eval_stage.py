"""The heldout-eval stage on tiny hand-built models, run as the flow runs it (tests/stage_harness.py): KL, win
rates, the reward-hacking verdict over earlier heldout-eval artifacts, promotion of the version this run registered,
the sample table, the artifact's files and the MLflow run."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

from rlhf_core.demo import render_prompt
from tasks import heldout_eval, tracking
from tasks.config import PipelineConfig, load_config
from tasks.heldout_eval import CHAMPION, EVAL_SAMPLES, HACKING_CODES, STATUS_TAG, Inputs, Result
from tasks.retries import retry_on_transient_io
from tasks.run_store import Artifact
from tasks.runtime import ModelInput
from tests.stage_harness import StageHarness
from tests.tiny_models import good_token_reward_model, gpt2_config, save_model_dir, word_tokenizer

N_PROMPTS = 6
DOCUMENTED_COLUMNS = {"prompt", "reference_reply", "policy_reply", "proxy_policy", "proxy_reference",
                      "heldout_policy", "heldout_reference", "gold_policy", "gold_reference", "kl", "length"}
WORD_PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
                "a small star", "fast blue tree", "q slow dog"]


# --- tiny models ---------------------------------------------------------------------------------------




def _random_lm(tokenizer: PreTrainedTokenizerFast, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(len(tokenizer)))


def _always_good_lm(tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    """Says 'good' at every step with p ~ 0.999: ln_f outputs e_0 everywhere, and (tied) logits = wte[:, 0]."""
    model = _random_lm(tokenizer, 3)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = 0.0
        model.transformer.wte.weight[tokenizer.convert_tokens_to_ids("good"), 0] = 10.0
    return model




@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tokenizer = word_tokenizer()
    root = tmp_path_factory.mktemp("models")
    reference = _random_lm(tokenizer, 0)
    perturbed = _random_lm(tokenizer, 0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return {
        "reference": save_model_dir(reference, tokenizer, root / "reference"),
        "policy_copy": save_model_dir(reference, tokenizer, root / "policy_copy"),
        "perturbed": save_model_dir(perturbed, tokenizer, root / "perturbed"),
        "good": save_model_dir(_always_good_lm(tokenizer), tokenizer, root / "good"),
        "proxy": save_model_dir(good_token_reward_model(tokenizer, 1), tokenizer, root / "proxy"),
        "heldout": save_model_dir(good_token_reward_model(tokenizer, 2), tokenizer, root / "heldout"),
    }


# --- the run, its inputs and configs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageHarness]:
    harness = StageHarness(tmp_path_factory.mktemp("heldout-eval") / "state")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def fixed(harness: StageHarness, models: dict[str, str]) -> dict[str, ModelInput]:
    """The inputs every iteration shares: the reference (SFT) policy and the two reward models."""
    return {"reference": harness.model("sft", models["reference"]),
            "proxy": harness.model("reward-model", models["proxy"]),
            "heldout": harness.model("reward-model", models["heldout"])}


def data_artifact(harness: StageHarness, tmp_path: Path, prompts: list[str] | None = None,
                  column: str = "prompt") -> Artifact:
    """A data-prep artifact holding only what heldout-eval reads: the evaluation prompts."""
    path = tmp_path / "eval_prompts.parquet"
    prompts = prompts or WORD_PROMPTS
    pq.write_table(pa.table({column: prompts, "extra": list(range(len(prompts)))}), path)
    return harness.artifact("data-prep", {"eval_prompts.parquet": path}, {"eval_prompts": "eval_prompts.parquet"})


def ppo_policy(harness: StageHarness, folder: str, label: str | None = None) -> tuple[ModelInput, str | None]:
    """A ppo-iteration artifact holding ``folder`` as its policy; with ``label`` it is also a stage of this run that
    registered the policy (as ppo-iteration's publish does), so heldout-eval can promote that version."""
    artifact = harness.artifact("ppo-iteration", {"policy": folder}, {"policy": "policy"})
    uri = harness.published(label, artifact, {"policy": (harness.names.policy_model, "policy")})["policy"] \
        if label else None
    return ModelInput(artifact, "policy"), uri


def config(*overrides: str, demo: bool = False) -> PipelineConfig:
    source = ["refresh.enabled=false"] if demo else ["data.source=files", "data.files=[unused.parquet]",
                                                      "refresh.enabled=false"]
    return load_config(preset="tiny", overrides=[
        *source, "device=cpu", f"eval.n_prompts={N_PROMPTS}", "eval.batch_size=4", "eval.temperature=1.0",
        "eval.kl_budget=100", "ppo.generation.max_new_tokens=8", *overrides])


def earlier_eval(harness: StageHarness, proxy: float, heldout: float, iteration: int,
                 rm_generation: int = 0) -> Artifact:
    """An earlier iteration's heldout-eval artifact (only the verdict's metrics matter)."""
    metrics = {"eval/proxy/mean": proxy, "eval/heldout/mean": heldout, "eval/kl/mean": 0.5,
               "eval/length/mean": 4.0, "eval/repetition_rate": 0.0, "eval/iteration": float(iteration),
               "eval/rm_generation": float(rm_generation)}
    return harness.artifact("heldout-eval", {}, asdict(Result(iteration, metrics, "ok", [], True)))


def evaluate(harness: StageHarness, label: str, cfg: heldout_eval.Config, data: Artifact, policy: ModelInput,
             fixed: dict[str, ModelInput], **inputs: object) -> tuple[Artifact, Result]:
    artifact = harness.run(heldout_eval, label, cfg, Inputs(data, policy, fixed["reference"], fixed["proxy"],
                                                            fixed["heldout"], **inputs))
    return artifact, heldout_eval.STAGE.result(artifact)


def champion(harness: StageHarness) -> int | None:
    return tracking.get_alias_version(harness.names.policy_model, CHAMPION)


def version(uri: str | None) -> int:
    assert uri is not None
    return tracking.parse_model_uri(uri).version


# --- policy == reference -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def same(harness: StageHarness, models: dict[str, str], fixed: dict[str, ModelInput],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, Result, str, Inputs]:
    """Iteration 2 of a policy identical to the reference, registered by this run's ppo-iteration-2."""
    data = data_artifact(harness, tmp_path_factory.mktemp("same"))
    policy, uri = ppo_policy(harness, models["policy_copy"], "ppo-iteration-2")
    artifact, result = evaluate(harness, "heldout-eval-2", heldout_eval.Config.of(config(), 2, 0), data, policy, fixed)
    return artifact, result, uri, Inputs(data, policy, fixed["reference"], fixed["proxy"], fixed["heldout"])


def test_policy_equal_to_reference_has_zero_kl_and_ties(same: tuple[Artifact, Result, str, Inputs]) -> None:
    _, result, _, _ = same
    m = result.metrics
    assert abs(m["eval/kl/mean"]) < 1e-5 and abs(m["eval/kl/k3_mean"]) < 1e-5
    assert m["eval/win_rate/proxy"] == 0.5 and m["eval/win_rate/heldout"] == 0.5
    assert m["eval/proxy/mean"] == pytest.approx(m["eval/reference/proxy/mean"])
    assert m["eval/heldout/mean"] == pytest.approx(m["eval/reference/heldout/mean"])
    assert m["eval/length/mean"] == m["eval/reference/length/mean"] > 0
    assert "eval/gold/mean" not in m and "eval/win_rate/gold" not in m  # files source: no gold
    assert result.status == "ok" and m["eval/hacking"] == HACKING_CODES["ok"]
    assert (result.iteration, m["eval/iteration"], m["eval/rm_generation"]) == (2, 2.0, 0.0)


def test_samples_table_has_the_documented_columns_and_one_row_per_prompt(
        same: tuple[Artifact, Result, str, Inputs]) -> None:
    artifact, result, _, _ = same
    table = pq.read_table(artifact.path(result.samples))
    assert DOCUMENTED_COLUMNS <= set(table.column_names)
    assert tuple(table.column_names) == EVAL_SAMPLES.names
    rows = table.to_pylist()
    assert len(rows) == N_PROMPTS
    assert [r["prompt"] for r in rows] == WORD_PROMPTS[:N_PROMPTS]  # the first n_prompts rows, in order
    assert all(r["policy_reply"] == r["reference_reply"] for r in rows)
    assert all(r["gold_policy"] is None and r["gold_reference"] is None for r in rows)
    assert all(r["proxy_policy"] == r["proxy_reference"] and abs(r["kl"]) < 1e-5 for r in rows)
    assert 0 < sum(r["length"] for r in rows) / len(rows) == result.metrics["eval/length/mean"]


def test_the_artifact_holds_the_verdict_files_and_plots(same: tuple[Artifact, Result, str, Inputs]) -> None:
    artifact, result, _, inputs = same
    saved = json.loads(artifact.path(result.metrics_file).read_text())
    assert (saved["iteration"], saved["status"], saved["reasons"]) == (2, "ok", [])
    assert saved["metrics"] == {k: (None if math.isnan(v) else v) for k, v in result.metrics.items()}
    assert artifact.path(result.reasons_file).read_text() == "no findings\n"
    assert all(artifact.path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in result.plots)
    assert set(artifact.record.files) >= {result.samples, result.metrics_file, result.reasons_file, *result.plots}
    # the record names its inputs by identity: what registered_input follows back to ppo-iteration-2
    assert artifact.record.inputs["policy"] == inputs.policy.identity()
    assert artifact.record.inputs["best_of_n"] is None and artifact.record.inputs["earlier"] == []


def test_equal_policy_is_promoted_and_everything_is_logged_to_the_nested_run(
        harness: StageHarness, same: tuple[Artifact, Result, str, Inputs]) -> None:
    artifact, result, uri, _ = same
    assert result.promote and result.reasons == [] and result.metrics["eval/promoted"] == 1.0
    assert champion(harness) == version(uri)  # the version ppo-iteration-2 registered in this run
    assert harness.active.stage("heldout-eval-2").status == "completed"
    client = MlflowClient()
    run = harness.mlflow_run("heldout-eval-2")
    assert run.data.tags["mlflow.parentRunId"] == harness.parent_run_id
    assert run.data.tags[tracking.STAGE_TAG] == "heldout-eval-2" and run.data.tags[STATUS_TAG] == "ok"
    assert run.data.tags["rlhf.artifact_key"] == artifact.identity() and "rlhf.cached_from" not in run.data.tags
    assert run.data.params["iteration"] == "2" and run.data.params["rm_generation"] == "0"
    assert run.data.params["judging.n_prompts"] == str(N_PROMPTS)
    history = client.get_metric_history(run.info.run_id, "eval/win_rate/heldout")
    assert [(p.step, p.value) for p in history] == [(2, 0.5)]
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "eval")} == {
        "eval_samples.parquet", "eval_metrics.json", "eval_reasons.txt"}
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")} == {
        "eval_scores.png", "eval_lengths.png", "eval_overoptimisation.png"}


def test_a_later_run_reuses_the_artifact_and_promotes_the_version_it_registered(
        harness: StageHarness, same: tuple[Artifact, Result, str, Inputs]) -> None:
    artifact, result, first_uri, inputs = same
    later = StageHarness(harness.store.root, names=harness.names)  # another rlhf run on the same state folder
    try:
        ppo = inputs.policy.artifact
        uri = later.published("ppo-iteration-2", ppo, {"policy": (harness.names.policy_model, "policy")})["policy"]
        assert version(uri) > version(first_uri)  # its own version (on the same files)
        reused = later.run(heldout_eval, "heldout-eval-2", heldout_eval.Config.of(config(), 2, 0), inputs)
        assert reused.identity() == artifact.identity() and reused.record.produced_by == harness.run_id
        assert champion(harness) == version(uri)  # this run's version, not the one of the run that computed it
        run = later.mlflow_run("heldout-eval-2")
        assert run.data.tags["rlhf.cached_from"] == harness.run_id and run.data.tags[STATUS_TAG] == "ok"
        assert run.data.metrics["eval/win_rate/heldout"] == result.metrics["eval/win_rate/heldout"]
        assert later.active.stage("heldout-eval-2").cached_from == harness.run_id
    finally:
        later.close()


# --- other policies --------------------------------------------------------------------------------------


def test_perturbed_policy_has_positive_kl_and_an_unregistered_policy_is_never_champion(
        harness: StageHarness, models: dict[str, str], fixed: dict[str, ModelInput], tmp_path: Path) -> None:
    policy, _ = ppo_policy(harness, models["perturbed"])  # no stage of this run registered it
    before = champion(harness)
    cfg = heldout_eval.Config.of(config("eval.min_win_rate=0"), 1, 0)
    artifact, result = evaluate(harness, "heldout-eval-perturbed", cfg, data_artifact(harness, tmp_path), policy,
                                fixed)
    assert result.metrics["eval/kl/k3_mean"] > 0.1
    kl = pq.read_table(artifact.path(result.samples)).column("kl").to_pylist()
    assert sum(kl) / len(kl) == pytest.approx(result.metrics["eval/kl/mean"])
    assert result.promote  # the verdict allows it ...
    assert champion(harness) == before  # ... but there is no version of this run to promote


def test_hacked_history_is_flagged_and_blocks_promotion(harness: StageHarness, models: dict[str, str],
                                                         fixed: dict[str, ModelInput], tmp_path: Path) -> None:
    policy, uri = ppo_policy(harness, models["policy_copy"], "ppo-iteration-hacked")
    before = champion(harness)
    # proxy keeps rising and held-out keeps falling, ending at this iteration's (reference-equal) numbers
    earlier = (earlier_eval(harness, proxy=-10.0, heldout=10.0, iteration=1),
               earlier_eval(harness, proxy=-5.0, heldout=5.0, iteration=2))
    _, result = evaluate(harness, "heldout-eval-hacked", heldout_eval.Config.of(config(), 3, 0),
                         data_artifact(harness, tmp_path), policy, fixed, earlier=earlier)
    assert result.status == "hacking" and result.metrics["eval/hacking"] == HACKING_CODES["hacking"]
    assert any("held-out score fell" in reason for reason in result.reasons)
    assert not result.promote and any("'hacking'" in reason for reason in result.reasons)
    assert result.metrics["eval/promoted"] == 0.0
    assert champion(harness) == before != version(uri)
    assert harness.mlflow_run("heldout-eval-hacked").data.tags[STATUS_TAG] == "hacking"


def test_history_scored_by_an_earlier_proxy_rm_is_not_compared(
        harness: StageHarness, models: dict[str, str], fixed: dict[str, ModelInput], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The hacked history of the test above, but scored by the proxy RM before a promoted refresh: the detector
    # must not compare proxy scores across reward models, while the plot still shows those iterations.
    drawn: list[list[object]] = []
    curve = heldout_eval.overoptimisation_curve
    monkeypatch.setattr(heldout_eval, "overoptimisation_curve",
                        lambda points, **kw: drawn.append(points) or curve(points, **kw))
    policy, _ = ppo_policy(harness, models["policy_copy"])
    earlier = (earlier_eval(harness, proxy=-10.0, heldout=10.0, iteration=1),
               earlier_eval(harness, proxy=-5.0, heldout=5.0, iteration=2))
    _, result = evaluate(harness, "heldout-eval-rm-generation", heldout_eval.Config.of(config(), 3, 1),
                         data_artifact(harness, tmp_path), policy, fixed, earlier=earlier)
    assert result.status != "hacking", result.reasons
    assert not any("fell" in reason for reason in result.reasons)
    assert result.metrics["eval/rm_generation"] == 1.0
    [points] = drawn
    assert [(p.label, p.rm_generation) for p in points] == [("ref", 1), ("it 1", 0), ("it 2", 0), ("it 3", 1)]


@pytest.mark.filterwarnings("ignore:spearman:RuntimeWarning")  # every 'good good' reply scores the same
def test_winning_policy_with_an_improving_history_becomes_champion(
        harness: StageHarness, models: dict[str, str], fixed: dict[str, ModelInput], tmp_path: Path) -> None:
    # Two-token replies: 'good good' has no repeated trigram, and both RMs score the last token 'good' highest.
    policy, uri = ppo_policy(harness, models["good"], "ppo-iteration-good")
    earlier = (earlier_eval(harness, proxy=-10.0, heldout=-10.0, iteration=1),
               earlier_eval(harness, proxy=-5.0, heldout=-5.0, iteration=2))
    cfg = heldout_eval.Config.of(config("ppo.generation.max_new_tokens=2", "eval.min_win_rate=0.8"), 3, 0)
    artifact, result = evaluate(harness, "heldout-eval-good", cfg, data_artifact(harness, tmp_path), policy, fixed,
                                earlier=earlier)
    m = result.metrics
    assert result.status == "ok", result.reasons
    assert m["eval/win_rate/heldout"] >= 0.8 and m["eval/win_rate/proxy"] >= 0.8
    assert m["eval/heldout/mean"] > m["eval/reference/heldout/mean"]
    assert m["eval/kl/k3_mean"] > 1.0  # 'good' twice is far from a random reference
    assert set(pq.read_table(artifact.path(result.samples)).column("policy_reply").to_pylist()) == {"good good"}
    assert result.promote
    assert champion(harness) == version(uri)


def test_a_policy_below_the_win_rate_bar_is_not_promoted(harness: StageHarness, models: dict[str, str],
                                                         fixed: dict[str, ModelInput], tmp_path: Path) -> None:
    policy, uri = ppo_policy(harness, models["policy_copy"], "ppo-iteration-tie")
    before = champion(harness)
    cfg = heldout_eval.Config.of(config("eval.min_win_rate=0.6"), 1, 0)  # a tie wins half the time
    _, result = evaluate(harness, "heldout-eval-tie", cfg, data_artifact(harness, tmp_path), policy, fixed)
    assert result.status == "ok" and not result.promote
    assert result.reasons == ["not promoted: heldout win rate against the reference is 0.500, below "
                              "eval.min_win_rate=0.600"]
    assert champion(harness) == before != version(uri)


def test_demo_task_adds_finite_gold_scores(harness: StageHarness, models: dict[str, str],
                                           fixed: dict[str, ModelInput], tmp_path: Path) -> None:
    prompts = [render_prompt(m) for m in ("My order #12345 arrived damaged.", "I was charged twice!",
                                          "How do I reset my password?", "Where is my package?",
                                          "Please cancel my order.", "The app keeps crashing.")]
    policy, _ = ppo_policy(harness, models["policy_copy"])
    cfg = heldout_eval.Config.of(config(demo=True), 1, 0)
    assert cfg.judging.gold
    artifact, result = evaluate(harness, "heldout-eval-demo", cfg, data_artifact(harness, tmp_path, prompts),
                                policy, fixed)
    m = result.metrics
    assert math.isfinite(m["eval/gold/mean"]) and m["eval/gold/mean"] == m["eval/reference/gold/mean"]
    assert m["eval/win_rate/gold"] == 0.5
    rows = pq.read_table(artifact.path(result.samples)).to_pylist()
    assert [r["prompt"] for r in rows] == prompts
    assert all(math.isfinite(r["gold_policy"]) and r["gold_policy"] == r["gold_reference"] for r in rows)


def test_missing_prompt_column_fails_with_a_clear_error_and_publishes_nothing(
        harness: StageHarness, models: dict[str, str], fixed: dict[str, ModelInput], tmp_path: Path) -> None:
    policy, _ = ppo_policy(harness, models["policy_copy"])
    data = data_artifact(harness, tmp_path, ["a"], column="text")
    with pytest.raises(ValueError, match="no 'prompt' column"):
        evaluate(harness, "heldout-eval-bad", heldout_eval.Config.of(config(), 1, 0), data, policy, fixed)
    entry = harness.active.stage("heldout-eval-bad")
    assert entry.status == "failed" and entry.error.startswith("ValueError: ") and "no 'prompt' column" in entry.error
    assert harness.store.artifact(heldout_eval.NAME, entry.key) is None


# --- the task wrapper ----------------------------------------------------------------------------------


def test_config_slice_takes_the_hacking_rules_from_the_eval_section() -> None:
    cfg = heldout_eval.Config.of(config("eval.kl_budget=3", "eval.hacking_margin=0.2", "eval.min_win_rate=0.7"), 4, 2)
    assert (cfg.iteration, cfg.rm_generation, cfg.min_win_rate) == (4, 2, 0.7)
    assert (cfg.rules.kl_budget, cfg.rules.min_drop) == (3.0, 0.2)
    unset = heldout_eval.Config.of(config("eval.hacking_margin=0"), 1, 0)
    assert unset.rules.min_drop == heldout_eval.HackingRules.min_drop  # 0 keeps the rules' default drop


def test_task_retries_once_and_only_on_transient_io() -> None:
    task = heldout_eval.heldout_eval_task
    assert task.name == "heldout-eval" and task.retries == 1 and task.task_run_name == "{label}"
    assert task.retry_condition_fn is retry_on_transient_io
    assert heldout_eval.STAGE.name == heldout_eval.NAME == "heldout-eval"
