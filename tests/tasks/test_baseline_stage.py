"""The best-of-n stage on tiny hand-built models (points, table, plot, MLflow run on a temporary SQLite store),
and the heldout-eval hook that draws its points on the over-optimisation plot."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

from rlhf_core.demo import gold_score, render_prompt
from rlhf_core.evaluation.metrics import best_of_n_kl
from rlhf_core.models.roles import sequence_scores
from tasks import evaluate, tracking
from tasks.baseline_eval import (BEST_OF_N_SAMPLES, BestOfNResult, best_of_n_figure, best_of_n_task, run_best_of_n,
                                 sampling_temperature)
from tasks.config import PipelineConfig, load_config
from tasks.evaluate import run_heldout_eval
from tasks.retries import retry_on_transient_io
from tasks.state import StateDir
from tests.stage_tracking import module_tracking
from tests.tiny_models import gpt2_config, word_tokenizer

NS = (1, 2, 4)
WORD_PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
                "a small star"]
DEMO_PROMPTS = [render_prompt(m) for m in ("My order #12345 arrived damaged.", "I was charged twice!",
                                           "How do I reset my password?", "Where is my package?")]


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    with module_tracking(tmp_path_factory.mktemp("bon-tracking")) as state:
        yield state


# --- tiny models ---------------------------------------------------------------------------------------


def _save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: Path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _last_token_rm(tokenizer: PreTrainedTokenizerFast, seed: int) -> GPT2ForSequenceClassification:
    """Scores the LAST token only (blocks and positions zeroed): highest for 'good', spread over other words."""
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    with torch.no_grad():
        for block in model.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.transformer.wpe.weight.zero_()
        good = model.transformer.ln_f(model.transformer.wte.weight[tokenizer.convert_tokens_to_ids("good")])
        model.score.weight.copy_((good / good.norm() ** 2).unsqueeze(0))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tokenizer = word_tokenizer()
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    sft = GPT2LMHeadModel(gpt2_config(len(tokenizer)))
    return {"sft": _save(sft, tokenizer, root / "sft"),
            "proxy": _save(_last_token_rm(tokenizer, 1), tokenizer, root / "proxy"),
            "heldout": _save(_last_token_rm(tokenizer, 2), tokenizer, root / "heldout")}


def _config(*overrides: str, demo: bool = False) -> PipelineConfig:
    source = ["refresh.enabled=false"] if demo else ["data.source=files", "data.files=[unused.parquet]",
                                                      "refresh.enabled=false"]
    return load_config(preset="tiny", overrides=[
        *source, "device=cpu", "eval.n_prompts=64", "eval.batch_size=8", "eval.temperature=1.0",
        "eval.kl_budget=100", "ppo.generation.max_new_tokens=3",
        f"tracking.policy_model=policy-{uuid.uuid4().hex[:8]}", *overrides])


def _prompts(path: Path, prompts: list[str]) -> str:
    pq.write_table(pa.table({"prompt": prompts}), path)
    return str(path)


def _parent(config: PipelineConfig) -> str:
    with tracking.pipeline_run(config.tracking.experiment, "bon-test") as parent:
        return parent.info.run_id


def _run(models: dict[str, str], tmp: Path, prompts: list[str], demo: bool = False) -> tuple[str, BestOfNResult]:
    config = _config(demo=demo)
    parent = _parent(config)
    result = run_best_of_n(config, models["sft"], models["proxy"], models["heldout"],
                           _prompts(tmp / "eval_prompts.parquet", prompts), str(tmp / "out"), parent, ns=NS)
    return parent, result


@pytest.fixture(scope="module")
def files_run(state: StateDir, models: dict[str, str],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, BestOfNResult]:
    return _run(models, tmp_path_factory.mktemp("bon-files"), WORD_PROMPTS)


# --- the stage -------------------------------------------------------------------------------------------


def test_points_climb_in_kl_and_proxy_and_have_no_gold_without_a_gold_scorer(
        files_run: tuple[str, BestOfNResult]) -> None:
    _, result = files_run
    points = result.points
    assert [p["n"] for p in points] == list(NS)
    assert [p["kl"] for p in points] == pytest.approx([best_of_n_kl(n) for n in NS])
    assert points[0]["kl"] == 0.0 < points[1]["kl"] < points[2]["kl"]
    proxy = [p["proxy"] for p in points]
    assert proxy[0] <= proxy[1] <= proxy[2] and proxy[2] > proxy[0] + 0.05, proxy
    assert all(p["gold"] is None and math.isfinite(p["heldout"]) and p["length"] > 0 for p in points)


def test_table_holds_the_chosen_reply_per_prompt_and_n(files_run: tuple[str, BestOfNResult]) -> None:
    _, result = files_run
    table = pq.read_table(result.table_path)
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
        files_run: tuple[str, BestOfNResult], models: dict[str, str]) -> None:
    """Rescore each chosen reply from its text; rows whose text lost special tokens on decoding are skipped."""
    _, result = files_run
    tokenizer = word_tokenizer()
    proxy = GPT2ForSequenceClassification.from_pretrained(models["proxy"]).eval()
    checked = 0
    for row in pq.read_table(result.table_path).to_pylist():
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


def test_everything_is_logged_to_a_nested_best_of_n_run(files_run: tuple[str, BestOfNResult]) -> None:
    parent, result = files_run
    client = MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["stage"] == "best-of-n"
    assert run.data.params["ns"] == "[1, 2, 4]" and run.data.params["n_prompts"] == str(len(WORD_PROMPTS))
    history = client.get_metric_history(run.info.run_id, "best_of_n/proxy/mean")
    assert [(m.step, m.value) for m in history] == [(p["n"], pytest.approx(p["proxy"])) for p in result.points]
    assert "best_of_n/gold/mean" not in run.data.metrics
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "best_of_n")} == {
        "best_of_n.parquet", "best_of_n_points.json"}
    assert [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")] == ["best_of_n.png"]
    assert Path(result.plot_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((Path(result.table_path).parent / "best_of_n_points.json").read_text())
    assert saved["points"] == list(result.points)


def test_demo_task_adds_gold_of_the_chosen_replies(state: StateDir, models: dict[str, str], tmp_path: Path) -> None:
    _, result = _run(models, tmp_path, DEMO_PROMPTS, demo=True)
    assert all(math.isfinite(p["gold"]) for p in result.points)
    rows = pq.read_table(result.table_path).to_pylist()
    assert all(r["gold"] == pytest.approx(gold_score(r["prompt"], r["reply"])) for r in rows)
    for point in result.points:
        chosen = [r["gold"] for r in rows if r["n"] == point["n"]]
        assert sum(chosen) / len(chosen) == pytest.approx(point["gold"])
    assert "best_of_n/gold/mean" in MlflowClient().get_run(result.mlflow_run_id).data.metrics


def test_figure_has_one_line_per_judge() -> None:
    points = [{"n": 1, "kl": 0.0, "proxy": 0.1, "heldout": 0.2, "gold": 1.0},
              {"n": 4, "kl": best_of_n_kl(4), "proxy": 0.5, "heldout": 0.3, "gold": 0.9}]
    [ax] = best_of_n_figure(points).axes
    assert [line.get_label() for line in ax.get_lines()] == ["proxy RM (optimised)", "held-out RM", "gold"]
    assert list(ax.get_lines()[2].get_ydata()) == [1.0, 0.9]
    [ax] = best_of_n_figure([{**p, "gold": None} for p in points]).axes
    assert len(ax.get_lines()) == 2


def test_greedy_evaluation_samples_best_of_n_at_the_rollout_temperature() -> None:
    assert sampling_temperature(_config("eval.temperature=0", "ppo.generation.temperature=0.7")) == 0.7
    assert sampling_temperature(_config("eval.temperature=0.5")) == 0.5


def test_bad_ns_fail_before_any_work(state: StateDir, models: dict[str, str], tmp_path: Path) -> None:
    config = _config()
    with pytest.raises(ValueError, match=">= 1"):
        run_best_of_n(config, models["sft"], models["proxy"], models["heldout"], "missing.parquet",
                      str(tmp_path), "no-parent", ns=(0, 2))


def test_task_retries_once_and_only_on_transient_io() -> None:
    assert best_of_n_task.name == "best-of-n" and best_of_n_task.retries == 1
    assert best_of_n_task.retry_condition_fn is retry_on_transient_io
    assert best_of_n_task.fn is run_best_of_n


# --- the heldout-eval hook --------------------------------------------------------------------------------


def test_heldout_eval_draws_the_best_of_n_baseline_on_the_overoptimisation_plot(
        files_run: tuple[str, BestOfNResult], models: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, bon = files_run
    figures = []

    def capture(*args, **kwargs):
        figures.append(fig := evaluate_curve(*args, **kwargs))
        return fig

    evaluate_curve = evaluate.overoptimisation_curve
    monkeypatch.setattr(evaluate, "overoptimisation_curve", capture)
    config = _config()
    result = run_heldout_eval(config, models["sft"], models["sft"], models["proxy"], models["heldout"],
                              _prompts(tmp_path / "p.parquet", WORD_PROMPTS), str(tmp_path / "out"),
                              _parent(config), 1, best_of_n=list(bon.points))
    [ax] = figures[0].axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["proxy RM (optimised)", "held-out RM", "best-of-N (held-out RM)", "best-of-N (proxy RM)"]
    assert list(lines["best-of-N (held-out RM)"].get_xdata()) == [p["kl"] for p in bon.points]
    assert list(lines["best-of-N (held-out RM)"].get_ydata()) == [p["heldout"] for p in bon.points]
    assert list(lines["best-of-N (proxy RM)"].get_ydata()) == [p["proxy"] for p in bon.points]
    plots = {Path(a.path).name for a in MlflowClient().list_artifacts(result.mlflow_run_id, "plots")}
    assert "eval_overoptimisation.png" in plots
    assert result.status in ("ok", "warn")


def test_heldout_eval_rejects_a_best_of_n_point_without_kl(models: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lacks \['kl'\]"):
        run_heldout_eval(_config(), models["sft"], models["sft"], models["proxy"], models["heldout"],
                         "unused.parquet", str(tmp_path), "no-parent", 1, best_of_n=[{"proxy": 1.0, "heldout": 0.0}])
