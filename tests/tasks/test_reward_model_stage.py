"""The reward-model stage on a planted rule (the chosen reply says "good", the rejected one "bad"): both RMs
learn it, are saved, registered with the 'candidate' alias, and logged to a nested MLflow run with plots."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE
from transformers import AutoTokenizer, GPT2LMHeadModel

from rlhf_core.data import PREFERENCE_PAIRS, DataError
from rlhf_core.models.roles import load_reward_model
from tasks import tracking
from tasks.config import PipelineConfig, load_config
from tasks.io import write_parquet
from tasks.reward_model import (SCORES_PNG, RewardModelResult, pair_scores, read_pairs,
                                retry_on_transient_io_or_registry, reward_model_task, run_reward_model)
from tasks.state import StateDir
from tests.stage_tracking import module_tracking
from tests.tiny_models import WORDS, gpt2_config, word_tokenizer

FILLER = [w for w in WORDS if w not in ("good", "bad", "q")]
PROXY, HELDOUT = "test-proxy-rm", "test-heldout-rm"


def planted_pairs(n: int, seed: int) -> list[dict[str, object]]:
    """Pairs whose chosen reply holds "good" and rejected "bad" at a random place among filler words."""
    rng = random.Random(seed)

    def reply(marker: str) -> str:
        words = rng.sample(FILLER, rng.randint(2, 5))
        words.insert(rng.randint(0, len(words)), marker)
        return " " + " ".join(words)

    rows = []
    for i in range(n):
        prompt = "q " + " ".join(rng.sample(FILLER, 3))
        chosen, rejected = reply("good"), reply("bad")
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                     "margin": [None, float("nan"), 1.0][i % 3], "source_file": "planted", "source_row": i,
                     "pair_id": f"{seed}-{i}"})
    return rows


def tiny_config(*extra: str) -> PipelineConfig:
    return load_config(preset="tiny", overrides=[
        "device=cpu", "reward_model.training.epochs=4", "reward_model.heldout.epochs=4",
        "reward_model.training.learning_rate=0.003", "reward_model.heldout.learning_rate=0.003",
        f"tracking.reward_model={PROXY}", f"tracking.heldout_reward_model={HELDOUT}", *extra])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("rm-inputs")
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(len(tokenizer))).save_pretrained(root / "sft")
    tokenizer.save_pretrained(root / "sft")
    return SimpleNamespace(
        sft=str(root / "sft"),
        train=write_parquet(planted_pairs(160, seed=1), PREFERENCE_PAIRS, root / "train_pairs.parquet"),
        heldout=write_parquet(planted_pairs(64, seed=2), PREFERENCE_PAIRS, root / "heldout_pairs.parquet"),
        empty=write_parquet([], PREFERENCE_PAIRS, root / "empty.parquet"),
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    with module_tracking(tmp_path_factory.mktemp("rm-mlflow")) as state:
        yield state


@pytest.fixture(scope="module")
def parent_id(store: StateDir) -> str:
    with tracking.pipeline_run("rm-stage-test", "rm") as run:
        return run.info.run_id


@pytest.fixture(scope="module")
def stage(inputs: SimpleNamespace, parent_id: str, tmp_path_factory: pytest.TempPathFactory) -> RewardModelResult:
    out = tmp_path_factory.mktemp("rm-out")
    return run_reward_model(tiny_config(), inputs.train, inputs.heldout, inputs.sft, str(out), parent_id)


def test_both_models_learn_the_planted_rule_on_pairs_they_never_saw(stage: RewardModelResult,
                                                                   inputs: SimpleNamespace) -> None:
    m = stage.metrics
    assert m["rm/proxy/eval/accuracy"] >= 0.85 and m["rm/proxy/eval/n_pairs"] == 64
    assert m["rm/heldout/eval/accuracy"] >= 0.85 and m["rm/heldout/eval/n_pairs"] == 160
    assert m["rm/proxy/eval/margin_mean"] > 0 and m["rm/proxy/eval/score_std"] > 0
    assert m["rm/cross/agreement"] >= 0.8 and m["rm/cross/spearman"] > 0.3
    # The saved proxy, reloaded from disk, orders the held-out pairs as the stage reported.
    model, tokenizer = load_reward_model(stage.proxy_dir).eval(), AutoTokenizer.from_pretrained(stage.proxy_dir)
    chosen, rejected = pair_scores(model, tokenizer, read_pairs(inputs.heldout), max_length=64)
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(chosen)
    assert accuracy == pytest.approx(m["rm/proxy/eval/accuracy"], abs=1e-9)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id == 0
    assert model.config.n_embd == 32  # the SFT policy's backbone (tests.tiny_models), not the 'tiny' preset's 48


def test_both_models_are_registered_with_the_candidate_alias(stage: RewardModelResult) -> None:
    client = MlflowClient()
    assert (stage.proxy_uri, stage.proxy_version) == (f"models:/{PROXY}/1", 1)
    assert (stage.heldout_uri, stage.heldout_version) == (f"models:/{HELDOUT}/1", 1)
    for name in (PROXY, HELDOUT):
        version = client.get_model_version_by_alias(name, "candidate")
        assert int(version.version) == 1 and version.run_id == stage.mlflow_run_id
    assert Path(stage.proxy_dir, "config.json").is_file() and Path(stage.heldout_dir, "tokenizer.json").is_file()


def test_the_nested_run_holds_params_curves_plots_and_metrics(stage: RewardModelResult, parent_id: str) -> None:
    client = MlflowClient()
    run = client.get_run(stage.mlflow_run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent_id and run.data.tags["stage"] == "reward-model"
    assert run.data.params["reward_model.init"] == "sft"
    assert run.data.params["reward_model.training.epochs"] == "4"
    assert run.data.metrics["rm/proxy/eval/accuracy"] == pytest.approx(stage.metrics["rm/proxy/eval/accuracy"])
    steps = int(stage.metrics["rm/proxy/train/steps"])  # 4 epochs x ceil(160 / 16)
    assert steps == 40
    assert len(client.get_metric_history(stage.mlflow_run_id, "rm/proxy/train/loss")) == steps
    evals = client.get_metric_history(stage.mlflow_run_id, "rm/heldout/eval/accuracy")
    # Evaluations during training, the last at the held-out RM's own final step (4 epochs x 64 / 16 pairs).
    assert len(evals) >= 4 and max(e.step for e in evals) == stage.metrics["rm/heldout/train/steps"] == 16
    assert max(evals, key=lambda e: e.step).value == stage.metrics["rm/heldout/eval/accuracy"]
    plots = {Path(a.path).name for a in client.list_artifacts(stage.mlflow_run_id, "plots")}
    assert plots == {"rm_proxy_loss.png", "rm_heldout_loss.png", SCORES_PNG}
    out = Path(stage.metrics_json).parent
    assert all((out / name).read_bytes().startswith(b"\x89PNG") for name in plots)
    record = json.loads(Path(stage.metrics_json).read_text())
    assert record["metrics"] == pytest.approx(stage.metrics)
    assert {"rm/proxy/eval/accuracy", "rm/proxy/eval/margin_mean", "rm/proxy/eval/score_mean",
            "rm/proxy/eval/score_std", "rm/heldout/eval/accuracy", "rm/cross/agreement"} <= set(record["metrics"])
    assert record["proxy_uri"] == stage.proxy_uri and record["mlflow_run_id"] == stage.mlflow_run_id


def test_the_task_starts_from_a_registered_reward_model(stage: RewardModelResult, inputs: SimpleNamespace,
                                                        parent_id: str, tmp_path: Path) -> None:
    # init = the proxy's models:/ URI: no sft_model needed, the tokenizer comes with the model.
    config = tiny_config(f"reward_model.init={stage.proxy_uri}", "reward_model.training.epochs=1",
                         "reward_model.heldout.epochs=1", "tracking.reward_model=test-proxy-rm-2",
                         "tracking.heldout_reward_model=test-heldout-rm-2")
    result = reward_model_task.fn(config, inputs.train, inputs.heldout, None, str(tmp_path), parent_id)
    assert result.proxy_uri == "models:/test-proxy-rm-2/1"
    # Started from a model that already knows the rule: the held-out RM is good before much training.
    assert result.metrics["rm/proxy/eval/accuracy"] >= 0.85 and result.metrics["rm/heldout/eval/accuracy"] >= 0.85


def test_scratch_init_builds_the_configured_size(inputs: SimpleNamespace, parent_id: str, tmp_path: Path) -> None:
    config = tiny_config("reward_model.init=scratch", "reward_model.training.epochs=2",
                         "reward_model.heldout.epochs=1", "tracking.reward_model=test-proxy-rm-scratch",
                         "tracking.heldout_reward_model=test-heldout-rm-scratch")
    result = run_reward_model(config, inputs.train, inputs.heldout, inputs.sft, str(tmp_path), parent_id)
    proxy, held = load_reward_model(result.proxy_dir), load_reward_model(result.heldout_dir)
    assert proxy.config.n_embd == held.config.n_embd == 48 and proxy.config.n_layer == 2  # sft.model_size=tiny
    assert result.metrics["rm/proxy/eval/accuracy"] >= 0.85


def test_missing_or_empty_tables_fail_naming_the_file(inputs: SimpleNamespace, parent_id: str,
                                                      tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "train_pairs.parquet")
    with pytest.raises(FileNotFoundError, match=r"nope/train_pairs\.parquet does not exist; run the data-prep"):
        run_reward_model(tiny_config(), missing, inputs.heldout, inputs.sft, str(tmp_path), parent_id)
    with pytest.raises(ValueError, match=r"empty\.parquet has no rows"):
        run_reward_model(tiny_config(), inputs.train, inputs.empty, inputs.sft, str(tmp_path), parent_id)
    with pytest.raises(ValueError, match="sft_model is None"):
        run_reward_model(tiny_config(), inputs.train, inputs.heldout, None, str(tmp_path), parent_id)
    assert not any(tmp_path.iterdir())  # failed before writing anything


@pytest.mark.parametrize("error, retried", [
    (ValueError("bad setting"), False), (FileNotFoundError("gone"), False), (KeyError("column"), False),
    (DataError("bad table"), False), (RuntimeError("bug"), False), (ConnectionError("reset"), True),
    (MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE), True),
    (MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST), False),
    (MlflowException("a bug, default code"), False),
])
def test_retries_only_transient_io_and_registry_errors(error: BaseException, retried: bool) -> None:
    state = SimpleNamespace(result=lambda raise_on_failure=True: error)
    assert retry_on_transient_io_or_registry(None, None, state) is retried
    assert reward_model_task.retries == 1
