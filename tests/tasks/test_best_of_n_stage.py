"""The best-of-n stage on tiny hand-built models, run as the flow runs it (tests/stage_harness.py): points, table,
plot, the artifact and its MLflow run; and the heldout-eval hook that draws its points on the over-optimisation
plot."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.demo import gold_score, render_prompt
from rlhf_core.evaluation.metrics import best_of_n_kl
from rlhf_core.models.roles import sequence_scores
from tasks import best_of_n, heldout_eval, tracking
from tasks.best_of_n import BEST_OF_N_SAMPLES, Result, best_of_n_figure
from tasks.config import PipelineConfig, load_config
from tasks.retries import retry_on_transient_io
from tasks.run_store import Artifact
from tasks.runtime import ModelInput
from tests.stage_harness import StageHarness
from tests.tiny_models import good_token_reward_model, gpt2_config, save_model_dir, word_tokenizer

NS = (1, 2, 4)
WORD_PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
                "a small star"]
DEMO_PROMPTS = [render_prompt(m) for m in ("My order #12345 arrived damaged.", "I was charged twice!",
                                           "How do I reset my password?", "Where is my package?")]


# --- tiny models ---------------------------------------------------------------------------------------






@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tokenizer = word_tokenizer()
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    sft = GPT2LMHeadModel(gpt2_config(len(tokenizer)))
    return {"sft": save_model_dir(sft, tokenizer, root / "sft"),
            "proxy": save_model_dir(good_token_reward_model(tokenizer, 1), tokenizer, root / "proxy"),
            "heldout": save_model_dir(good_token_reward_model(tokenizer, 2), tokenizer, root / "heldout")}


# --- the run, its inputs and configs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageHarness]:
    harness = StageHarness(tmp_path_factory.mktemp("best-of-n") / "state")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def fixed(harness: StageHarness, models: dict[str, str]) -> dict[str, ModelInput]:
    """The SFT policy (sft artifact) and both reward models (reward-model artifact)."""
    return {"sft": harness.model("sft", models["sft"]), "proxy": harness.model("reward-model", models["proxy"]),
            "heldout": harness.model("reward-model", models["heldout"])}


def config(*overrides: str, demo: bool = False) -> PipelineConfig:
    source = ["refresh.enabled=false"] if demo else ["data.source=files", "data.files=[unused.parquet]",
                                                      "refresh.enabled=false"]
    return load_config(preset="tiny", overrides=[
        *source, "device=cpu", "eval.n_prompts=64", "eval.batch_size=8", "eval.temperature=1.0",
        "eval.kl_budget=100", "ppo.generation.max_new_tokens=3", *overrides])


def bon_config(*overrides: str, demo: bool = False, ns: tuple[int, ...] = NS) -> best_of_n.Config:
    return replace(best_of_n.Config.of(config(*overrides, demo=demo)), ns=ns)


def data_artifact(harness: StageHarness, tmp_path: Path | None, prompts: list[str] = ()) -> Artifact:
    """A data-prep artifact whose evaluation prompts are ``prompts`` (without ``tmp_path``: a file that is not
    there, for checks that must fail before the prompts are read)."""
    if tmp_path is None:
        return harness.artifact("data-prep", {}, {"eval_prompts": "missing.parquet"})
    path = tmp_path / "eval_prompts.parquet"
    pq.write_table(pa.table({"prompt": list(prompts)}), path)
    return harness.artifact("data-prep", {"eval_prompts.parquet": path}, {"eval_prompts": "eval_prompts.parquet"})


def run_best_of_n(harness: StageHarness, label: str, cfg: best_of_n.Config, data: Artifact,
                  fixed: dict[str, ModelInput]) -> tuple[Artifact, Result]:
    artifact = harness.run(best_of_n, label, cfg, best_of_n.Inputs(data, fixed["sft"], fixed["proxy"],
                                                                   fixed["heldout"]))
    return artifact, best_of_n.STAGE.result(artifact)


@pytest.fixture(scope="module")
def files_run(harness: StageHarness, fixed: dict[str, ModelInput],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, Result]:
    data = data_artifact(harness, tmp_path_factory.mktemp("bon-files"), WORD_PROMPTS)
    return run_best_of_n(harness, "best-of-n", bon_config(), data, fixed)


# --- the stage -------------------------------------------------------------------------------------------


def test_points_climb_in_kl_and_proxy_and_have_no_gold_without_a_gold_scorer(
        files_run: tuple[Artifact, Result]) -> None:
    _, result = files_run
    points = result.points
    assert [p["n"] for p in points] == list(NS)
    assert [p["kl"] for p in points] == pytest.approx([best_of_n_kl(n) for n in NS])
    assert points[0]["kl"] == 0.0 < points[1]["kl"] < points[2]["kl"]
    proxy = [p["proxy"] for p in points]
    assert proxy[0] <= proxy[1] <= proxy[2] and proxy[2] > proxy[0] + 0.05, proxy
    assert all(p["gold"] is None and math.isfinite(p["heldout"]) and p["length"] > 0 for p in points)


def test_table_holds_the_chosen_reply_per_prompt_and_n(files_run: tuple[Artifact, Result]) -> None:
    artifact, result = files_run
    table = pq.read_table(artifact.path(result.table))
    assert tuple(table.column_names) == BEST_OF_N_SAMPLES.names
    rows = table.to_pylist()
    assert [(r["prompt"], r["n"]) for r in rows] == [(p, n) for p in WORD_PROMPTS for n in NS]
    assert all(0 <= r["sample"] < r["n"] and r["gold"] is None for r in rows)
    assert all(r["sample"] == 0 for r in rows if r["n"] == 1)
    for point in result.points:
        chosen = [r for r in rows if r["n"] == point["n"]]
        for judge in ("proxy", "heldout", "length"):
            assert sum(r[judge] for r in chosen) / len(chosen) == pytest.approx(point[judge])
    by_prompt = {p: [r["proxy"] for r in rows if r["prompt"] == p] for p in WORD_PROMPTS}
    assert all(a <= b <= c for a, b, c in by_prompt.values())  # nested pools: per prompt, not only on average


def test_table_proxy_column_is_the_proxy_score_of_the_reply_in_that_row(
        files_run: tuple[Artifact, Result], models: dict[str, str]) -> None:
    """Rescore each chosen reply from its text; rows whose text lost special tokens on decoding are skipped."""
    artifact, result = files_run
    tokenizer = word_tokenizer()
    proxy = GPT2ForSequenceClassification.from_pretrained(models["proxy"]).eval()
    checked = 0
    for row in pq.read_table(artifact.path(result.table)).to_pylist():
        reply_ids = tokenizer(row["reply"], add_special_tokens=False)["input_ids"]
        if len(reply_ids) + row["stopped"] != row["length"]:
            continue
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] + reply_ids
        ids += [tokenizer.eos_token_id] if row["stopped"] else []
        with torch.no_grad():
            score = sequence_scores(proxy, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        assert float(score[0]) == pytest.approx(row["proxy"], abs=1e-4), row
        checked += 1
    assert checked >= len(WORD_PROMPTS) * len(NS) // 2


def test_the_artifact_holds_table_points_and_plot(files_run: tuple[Artifact, Result]) -> None:
    artifact, result = files_run
    assert (result.table, result.points_file, result.plot) == ("best_of_n.parquet", "best_of_n_points.json",
                                                               "plots/best_of_n.png")
    assert artifact.path(result.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(artifact.path(result.points_file).read_text())["points"] == result.points
    assert set(artifact.record.files) >= {result.table, result.points_file, result.plot}
    assert artifact.record.config["ns"] == list(NS)


def test_everything_is_logged_to_a_nested_best_of_n_run(harness: StageHarness,
                                                         files_run: tuple[Artifact, Result]) -> None:
    artifact, result = files_run
    client = MlflowClient()
    run = harness.mlflow_run("best-of-n")
    assert run.data.tags["mlflow.parentRunId"] == harness.parent_run_id
    assert run.data.tags[tracking.STAGE_TAG] == "best-of-n" and run.data.tags["rlhf.artifact_key"] == \
        artifact.identity()
    assert run.data.params["ns"] == "[1, 2, 4]" and run.data.params["judging.n_prompts"] == "64"
    assert run.data.params["temperature"] == "1.0" and run.data.params["judging.gold"] == "False"
    history = client.get_metric_history(run.info.run_id, "best_of_n/proxy/mean")
    assert sorted((m.step, m.value) for m in history) == [(p["n"], pytest.approx(p["proxy"])) for p in result.points]
    kl = client.get_metric_history(run.info.run_id, "best_of_n/kl")
    assert sorted((m.step, m.value) for m in kl) == [(n, pytest.approx(best_of_n_kl(n))) for n in NS]
    assert "best_of_n/gold/mean" not in run.data.metrics
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "best_of_n")} == {
        "best_of_n.parquet", "best_of_n_points.json"}
    assert [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")] == ["best_of_n.png"]


def test_demo_task_adds_gold_of_the_chosen_replies(harness: StageHarness, fixed: dict[str, ModelInput],
                                                   tmp_path: Path) -> None:
    artifact, result = run_best_of_n(harness, "best-of-n-demo", bon_config(demo=True),
                                     data_artifact(harness, tmp_path, DEMO_PROMPTS), fixed)
    assert all(math.isfinite(p["gold"]) for p in result.points)
    rows = pq.read_table(artifact.path(result.table)).to_pylist()
    assert [r["prompt"] for r in rows][::len(NS)] == DEMO_PROMPTS
    assert all(r["gold"] == pytest.approx(gold_score(r["prompt"], r["reply"])) for r in rows)
    for point in result.points:
        chosen = [r["gold"] for r in rows if r["n"] == point["n"]]
        assert sum(chosen) / len(chosen) == pytest.approx(point["gold"])
    assert "best_of_n/gold/mean" in harness.mlflow_run("best-of-n-demo").data.metrics


def test_figure_has_one_line_per_judge() -> None:
    points = [{"n": 1, "kl": 0.0, "proxy": 0.1, "heldout": 0.2, "gold": 1.0},
              {"n": 4, "kl": best_of_n_kl(4), "proxy": 0.5, "heldout": 0.3, "gold": 0.9}]
    [ax] = best_of_n_figure(points).axes
    assert [line.get_label() for line in ax.get_lines()] == ["proxy RM (optimised)", "held-out RM", "gold"]
    assert list(ax.get_lines()[2].get_ydata()) == [1.0, 0.9]
    [ax] = best_of_n_figure([{**p, "gold": None} for p in points]).axes
    assert len(ax.get_lines()) == 2


def test_greedy_evaluation_samples_best_of_n_at_the_rollout_temperature() -> None:
    assert best_of_n.Config.of(config("eval.temperature=0", "ppo.generation.temperature=0.7")).temperature == 0.7
    assert best_of_n.Config.of(config("eval.temperature=0.5")).temperature == 0.5
    assert best_of_n.Config.of(config()).ns == best_of_n.DEFAULT_NS


def test_bad_ns_fail_before_any_work(harness: StageHarness, fixed: dict[str, ModelInput]) -> None:
    # the prompts file is missing: reading it first would fail with FileNotFoundError instead
    with pytest.raises(ValueError, match=">= 1"):
        run_best_of_n(harness, "best-of-n-bad-ns", bon_config(ns=(0, 2)), data_artifact(harness, None), fixed)
    entry = harness.active.stage("best-of-n-bad-ns")
    assert entry.status == "failed" and harness.store.artifact(best_of_n.NAME, entry.key) is None


def test_task_retries_once_and_only_on_transient_io() -> None:
    task = best_of_n.best_of_n_task
    assert task.name == "best-of-n" and task.retries == 1 and task.task_run_name == "{label}"
    assert task.retry_condition_fn is retry_on_transient_io
    assert best_of_n.STAGE.name == "best-of-n" and best_of_n.STAGE.result_type is Result


# --- the heldout-eval hook --------------------------------------------------------------------------------


def test_heldout_eval_draws_the_best_of_n_baseline_on_the_overoptimisation_plot(
        harness: StageHarness, files_run: tuple[Artifact, Result], fixed: dict[str, ModelInput], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bon_artifact, bon = files_run
    figures = []

    def capture(*args, **kwargs):
        figures.append(fig := curve(*args, **kwargs))
        return fig

    curve = heldout_eval.overoptimisation_curve
    monkeypatch.setattr(heldout_eval, "overoptimisation_curve", capture)
    inputs = heldout_eval.Inputs(data_artifact(harness, tmp_path, WORD_PROMPTS), fixed["sft"], fixed["sft"],
                                 fixed["proxy"], fixed["heldout"], best_of_n=bon_artifact)
    artifact = harness.run(heldout_eval, "heldout-eval-1", heldout_eval.Config.of(config(), 1, 0), inputs)
    [ax] = figures[0].axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["proxy RM (optimised)", "held-out RM", "best-of-N (held-out RM)", "best-of-N (proxy RM)"]
    assert list(lines["best-of-N (held-out RM)"].get_xdata()) == [p["kl"] for p in bon.points]
    assert list(lines["best-of-N (held-out RM)"].get_ydata()) == [p["heldout"] for p in bon.points]
    assert list(lines["best-of-N (proxy RM)"].get_ydata()) == [p["proxy"] for p in bon.points]
    assert artifact.record.inputs["best_of_n"] == bon_artifact.identity()  # the baseline is part of the key
    run = harness.mlflow_run("heldout-eval-1")
    plots = {Path(a.path).name for a in MlflowClient().list_artifacts(run.info.run_id, "plots")}
    assert "eval_overoptimisation.png" in plots
    assert heldout_eval.STAGE.result(artifact).status in ("ok", "warn")


def test_heldout_eval_rejects_a_best_of_n_point_without_kl_before_any_work(
        harness: StageHarness, fixed: dict[str, ModelInput]) -> None:
    bad = harness.artifact("best-of-n", {}, {"points": [{"proxy": 1.0, "heldout": 0.0}]})
    inputs = heldout_eval.Inputs(data_artifact(harness, None), fixed["sft"], fixed["sft"], fixed["proxy"],
                                 fixed["heldout"], best_of_n=bad)
    with pytest.raises(ValueError, match=r"lacks \['kl'\]"):  # not FileNotFoundError: the prompts come later
        harness.run(heldout_eval, "heldout-eval-bad-baseline", heldout_eval.Config.of(config(), 1, 0), inputs)
