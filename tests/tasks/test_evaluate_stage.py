"""The heldout-eval stage on tiny hand-built models: KL, win rates, the reward-hacking verdict, promotion,
the sample table and the MLflow artifacts, on a temporary SQLite store."""

from __future__ import annotations

import dataclasses
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

from rlhf_core.config import GenerationConfig
from rlhf_core.demo import render_prompt
from rlhf_core.evaluation.policy_eval import evaluation_generation, rollout_kl
from rlhf_core.training.rollout import generate, left_pad
from tasks import tracking
from tasks.config import PipelineConfig, load_config
from tasks.retries import retry_on_transient_io
from tasks.evaluate import (CHAMPION, EVAL_SAMPLES, HACKING_CODES, STATUS_TAG, EvalResult, heldout_eval_task,
                            run_heldout_eval)
from tasks.state import StateDir
from tests.stage_tracking import module_tracking
from tests.tiny_models import gpt2_config, word_tokenizer

N_PROMPTS = 6
DOCUMENTED_COLUMNS = {"prompt", "reference_reply", "policy_reply", "proxy_policy", "proxy_reference",
                      "heldout_policy", "heldout_reference", "gold_policy", "gold_reference", "kl", "length"}
WORD_PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
                "a small star", "fast blue tree", "q slow dog"]


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    with module_tracking(tmp_path_factory.mktemp("eval-tracking")) as state:
        yield state


# --- tiny models ---------------------------------------------------------------------------------------


def _save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: Path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


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


def _good_token_rm(tokenizer: PreTrainedTokenizerFast, seed: int) -> GPT2ForSequenceClassification:
    """Scores the LAST token only: cosine of LN(wte[last]) with LN(wte['good']), so 1.0 for 'good', < 1 else.

    Blocks add nothing (zero output projections) and positions are zero, so the last hidden state is
    LN(wte[last token]) and the linear head reads it.
    """
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
    reference = _random_lm(tokenizer, 0)
    perturbed = _random_lm(tokenizer, 0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return {
        "reference": _save(reference, tokenizer, root / "reference"),
        "policy_copy": _save(reference, tokenizer, root / "policy_copy"),
        "perturbed": _save(perturbed, tokenizer, root / "perturbed"),
        "good": _save(_always_good_lm(tokenizer), tokenizer, root / "good"),
        "proxy": _save(_good_token_rm(tokenizer, 1), tokenizer, root / "proxy"),
        "heldout": _save(_good_token_rm(tokenizer, 2), tokenizer, root / "heldout"),
    }


def _prompts(path: Path, prompts: list[str]) -> str:
    pq.write_table(pa.table({"prompt": prompts, "extra": list(range(len(prompts)))}), path)
    return str(path)


def _config(*overrides: str, demo: bool = False) -> PipelineConfig:
    source = ["refresh.enabled=false"] if demo else ["data.source=files", "data.files=[unused.parquet]",
                                                      "refresh.enabled=false"]
    return load_config(preset="tiny", overrides=[
        *source, "device=cpu", f"eval.n_prompts={N_PROMPTS}", "eval.batch_size=4", "eval.temperature=1.0",
        "eval.kl_budget=100", "ppo.generation.max_new_tokens=8",
        f"tracking.policy_model=policy-{uuid.uuid4().hex[:8]}", *overrides])


@dataclasses.dataclass
class Setup:
    config: PipelineConfig
    parent_run_id: str
    policy_uri: str
    version: int
    prompts: str


def _setup(state: StateDir, tmp_path: Path, policy_dir: str, *overrides: str, demo: bool = False,
           prompts: list[str] | None = None) -> Setup:
    """A config with a fresh registered policy name, a finished parent run, and the policy registered in it."""
    config = _config(*overrides, demo=demo)
    with tracking.pipeline_run(config.tracking.experiment, "eval-test") as parent:
        ref = tracking.register_model_dir(policy_dir, config.tracking.policy_model, parent.info.run_id)
    return Setup(config, parent.info.run_id, ref.uri, ref.version,
                 _prompts(tmp_path / "eval_prompts.parquet", prompts or WORD_PROMPTS))


def _evaluate(setup: Setup, models: dict[str, str], out: Path, iteration: int = 1,
              history: list[dict[str, float]] | None = None, policy_uri: str | None = None,
              rm_generation: int = 0) -> EvalResult:
    return run_heldout_eval(setup.config, policy_uri or setup.policy_uri, models["reference"], models["proxy"],
                            models["heldout"], setup.prompts, str(out), setup.parent_run_id, iteration, history,
                            rm_generation=rm_generation)


def _entry(proxy: float, heldout: float, iteration: int) -> dict[str, float]:
    """A previous iteration's metrics as the flow passes them (only the verdict's keys matter)."""
    return {"eval/proxy/mean": proxy, "eval/heldout/mean": heldout, "eval/kl/mean": 0.5,
            "eval/length/mean": 4.0, "eval/repetition_rate": 0.0, "eval/iteration": float(iteration)}


# --- policy == reference -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def same(state: StateDir, models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Setup, EvalResult]:
    tmp = tmp_path_factory.mktemp("same")
    setup = _setup(state, tmp, models["policy_copy"])
    return setup, _evaluate(setup, models, tmp / "out", iteration=2)


def test_policy_equal_to_reference_has_zero_kl_and_ties(same: tuple[Setup, EvalResult]) -> None:
    _, result = same
    m = result.metrics
    assert abs(m["eval/kl/mean"]) < 1e-5 and abs(m["eval/kl/k3_mean"]) < 1e-5
    assert m["eval/win_rate/proxy"] == 0.5 and m["eval/win_rate/heldout"] == 0.5
    assert m["eval/proxy/mean"] == pytest.approx(m["eval/reference/proxy/mean"])
    assert m["eval/heldout/mean"] == pytest.approx(m["eval/reference/heldout/mean"])
    assert m["eval/length/mean"] == m["eval/reference/length/mean"] > 0
    assert "eval/gold/mean" not in m and "eval/win_rate/gold" not in m  # files source: no gold
    assert result.status == "ok" and m["eval/hacking"] == HACKING_CODES["ok"]


def test_samples_table_has_the_documented_columns_and_one_row_per_prompt(same: tuple[Setup, EvalResult]) -> None:
    _, result = same
    table = pq.read_table(result.samples_path)
    assert DOCUMENTED_COLUMNS <= set(table.column_names)
    assert tuple(table.column_names) == EVAL_SAMPLES.names
    rows = table.to_pylist()
    assert len(rows) == N_PROMPTS
    assert [r["prompt"] for r in rows] == WORD_PROMPTS[:N_PROMPTS]  # the first n_prompts rows, in order
    assert all(r["policy_reply"] == r["reference_reply"] for r in rows)
    assert all(r["gold_policy"] is None and r["gold_reference"] is None for r in rows)
    assert all(r["proxy_policy"] == r["proxy_reference"] and abs(r["kl"]) < 1e-5 for r in rows)
    assert 0 < sum(r["length"] for r in rows) / len(rows) == result.metrics["eval/length/mean"]


def test_equal_policy_is_promoted_and_everything_is_logged_to_the_nested_run(same: tuple[Setup, EvalResult]) -> None:
    setup, result = same
    assert result.promoted and result.reasons == ()
    assert tracking.get_alias_version(setup.config.tracking.policy_model, CHAMPION) == setup.version
    client = MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    assert run.data.tags["mlflow.parentRunId"] == setup.parent_run_id
    assert run.data.tags["stage"] == "heldout-eval" and run.data.tags[STATUS_TAG] == "ok"
    assert run.data.params["iteration"] == "2" and run.data.params["policy_uri"] == setup.policy_uri
    history = client.get_metric_history(run.info.run_id, "eval/win_rate/heldout")
    assert [(p.step, p.value) for p in history] == [(2, 0.5)]
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "eval")} == {
        "eval_samples.parquet", "eval_metrics.json", "eval_reasons.txt"}
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")} == {
        "eval_scores.png", "eval_lengths.png", "eval_overoptimisation.png"}


# --- other policies --------------------------------------------------------------------------------------


def test_perturbed_policy_has_positive_kl_and_an_unregistered_path_is_not_promoted(
        state: StateDir, models: dict[str, str], tmp_path: Path) -> None:
    setup = _setup(state, tmp_path, models["perturbed"])
    result = _evaluate(setup, models, tmp_path / "out", policy_uri=models["perturbed"])
    assert result.metrics["eval/kl/k3_mean"] > 0.1
    kl = pq.read_table(result.samples_path).column("kl").to_pylist()
    assert sum(kl) / len(kl) == pytest.approx(result.metrics["eval/kl/mean"])
    assert not result.promoted
    assert any("not promoted" in reason for reason in result.reasons)
    assert tracking.get_alias_version(setup.config.tracking.policy_model, CHAMPION) is None


def test_hacked_history_is_flagged_and_blocks_promotion(state: StateDir, models: dict[str, str],
                                                         tmp_path: Path) -> None:
    setup = _setup(state, tmp_path, models["policy_copy"])
    # proxy keeps rising and held-out keeps falling, ending at this iteration's (reference-equal) numbers
    history = [_entry(proxy=-10.0, heldout=10.0, iteration=1), _entry(proxy=-5.0, heldout=5.0, iteration=2)]
    result = _evaluate(setup, models, tmp_path / "out", iteration=3, history=history)
    assert result.status == "hacking" and result.metrics["eval/hacking"] == HACKING_CODES["hacking"]
    assert any("held-out score fell" in reason for reason in result.reasons)
    assert not result.promoted and any("'hacking'" in reason for reason in result.reasons)
    assert tracking.get_alias_version(setup.config.tracking.policy_model, CHAMPION) is None
    assert MlflowClient().get_run(result.mlflow_run_id).data.tags[STATUS_TAG] == "hacking"


def test_history_scored_by_an_earlier_proxy_rm_is_not_compared(state: StateDir, models: dict[str, str],
                                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The hacked history of the test above, but scored by the proxy RM before a promoted refresh: the detector
    # must not compare proxy scores across reward models, while the plot still shows those iterations.
    from tasks import evaluate

    drawn: list[list[object]] = []
    curve = evaluate.overoptimisation_curve
    monkeypatch.setattr(evaluate, "overoptimisation_curve", lambda points, **kw: drawn.append(points) or curve(points, **kw))
    setup = _setup(state, tmp_path, models["policy_copy"])
    history = [_entry(proxy=-10.0, heldout=10.0, iteration=1), _entry(proxy=-5.0, heldout=5.0, iteration=2)]
    result = _evaluate(setup, models, tmp_path / "out", iteration=3, history=history, rm_generation=1)
    assert result.status != "hacking", result.reasons
    assert not any("fell" in reason for reason in result.reasons)
    assert result.metrics["eval/rm_generation"] == 1.0
    [points] = drawn
    assert [(p.label, p.rm_generation) for p in points] == [("ref", 1), ("it 1", 0), ("it 2", 0), ("it 3", 1)]


@pytest.mark.filterwarnings("ignore:spearman:RuntimeWarning")  # every 'good good' reply scores the same
def test_winning_policy_with_an_improving_history_becomes_champion(state: StateDir, models: dict[str, str],
                                                                    tmp_path: Path) -> None:
    # Two-token replies: 'good good' has no repeated trigram, and both RMs score the last token 'good' highest.
    setup = _setup(state, tmp_path, models["good"], "ppo.generation.max_new_tokens=2", "eval.min_win_rate=0.8")
    history = [_entry(proxy=-10.0, heldout=-10.0, iteration=1), _entry(proxy=-5.0, heldout=-5.0, iteration=2)]
    result = _evaluate(setup, models, tmp_path / "out", iteration=3, history=history)
    m = result.metrics
    assert result.status == "ok", result.reasons
    assert m["eval/win_rate/heldout"] >= 0.8 and m["eval/win_rate/proxy"] >= 0.8
    assert m["eval/heldout/mean"] > m["eval/reference/heldout/mean"]
    assert m["eval/kl/k3_mean"] > 1.0  # 'good' twice is far from a random reference
    assert set(pq.read_table(result.samples_path).column("policy_reply").to_pylist()) == {"good good"}
    assert result.promoted
    assert tracking.get_alias_version(setup.config.tracking.policy_model, CHAMPION) == setup.version


def test_demo_task_adds_finite_gold_scores(state: StateDir, models: dict[str, str], tmp_path: Path) -> None:
    prompts = [render_prompt(m) for m in ("My order #12345 arrived damaged.", "I was charged twice!",
                                          "How do I reset my password?", "Where is my package?",
                                          "Please cancel my order.", "The app keeps crashing.")]
    setup = _setup(state, tmp_path, models["policy_copy"], demo=True, prompts=prompts)
    result = _evaluate(setup, models, tmp_path / "out")
    m = result.metrics
    assert math.isfinite(m["eval/gold/mean"]) and m["eval/gold/mean"] == m["eval/reference/gold/mean"]
    assert m["eval/win_rate/gold"] == 0.5
    rows = pq.read_table(result.samples_path).to_pylist()
    assert [r["prompt"] for r in rows] == prompts
    assert all(math.isfinite(r["gold_policy"]) and r["gold_policy"] == r["gold_reference"] for r in rows)


def test_missing_prompt_column_fails_with_a_clear_error(state: StateDir, models: dict[str, str],
                                                         tmp_path: Path) -> None:
    setup = _setup(state, tmp_path, models["policy_copy"])
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a"]}), bad)
    with pytest.raises(ValueError, match="no 'prompt' column"):
        run_heldout_eval(setup.config, setup.policy_uri, models["reference"], models["proxy"], models["heldout"],
                         str(bad), str(tmp_path / "out"), setup.parent_run_id, 1)


# --- pure helpers and the task wrapper ------------------------------------------------------------------


def test_greedy_evaluation_is_top1_sampling_and_kl_of_a_model_to_itself_is_zero(models: dict[str, str]) -> None:
    greedy = evaluation_generation(GenerationConfig(max_new_tokens=5, temperature=0.7, top_k=5), 0.0, 3)
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.batch_size) == (1.0, 1, 1.0, 3)
    assert evaluation_generation(GenerationConfig(top_k=5), 0.5, 3).top_k == 5
    tokenizer = word_tokenizer()
    policy = GPT2LMHeadModel.from_pretrained(models["perturbed"]).eval()
    reference = GPT2LMHeadModel.from_pretrained(models["reference"]).eval()
    ids, mask = left_pad([tokenizer("the cat")["input_ids"], tokenizer("q")["input_ids"]], tokenizer.pad_token_id)
    outs = [generate(policy, ids, mask, greedy, [tokenizer.eos_token_id], 0, torch.Generator().manual_seed(s))
            for s in (0, 1)]
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)  # greedy ignores the seed
    k1, k3 = rollout_kl(policy, policy, outs[0])
    assert torch.equal(k1, torch.zeros(2)) and torch.equal(k3, torch.zeros(2))
    # k1 against a loop over the real response tokens of row 0
    k1, _ = rollout_kl(policy, reference, outs[0])
    full = outs[0].input_ids
    tq = ids.shape[1]
    expected = 0.0
    with torch.no_grad():  # one forward per real response token, on the unpadded prefix (no cache, no masks)
        for t in range(outs[0].response_ids.shape[1]):
            if outs[0].response_mask[0, t]:
                prefix = full[0, : tq + t][mask[0].tolist().index(True):].unsqueeze(0)
                token = full[0, tq + t]
                expected += float(policy(prefix).logits[0, -1].log_softmax(-1)[token]
                                  - reference(prefix).logits[0, -1].log_softmax(-1)[token])
    assert float(k1[0]) == pytest.approx(expected, abs=1e-4)


def test_task_retries_once_and_only_on_transient_io() -> None:
    assert heldout_eval_task.name == "heldout-eval" and heldout_eval_task.retries == 1
    assert heldout_eval_task.retry_condition_fn is retry_on_transient_io
    assert heldout_eval_task.fn is run_heldout_eval
