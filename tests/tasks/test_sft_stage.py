"""The sft stage on the demo task: a tiny GPT learns the demonstrations, is saved in the artifact as a Hugging Face
folder that reloads and generates, and is judged by gold after training; a base model is used as it is unless
fine-tuning is asked for."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.demo.tables import EVAL_PROMPTS
from rlhf_core.training.sft import eval_loss
from tasks import data_prep, sft
from tasks.config import PipelineConfig, SFTSection, load_config
from tasks.io import read_parquet
from tasks.run_store import Artifact, stage_key
from tasks.sft import read_demonstrations
from tests import model_families
from tests.stage_harness import StageHarness

#: Demo data and a tiny GPT; the gold report answers 16 evaluation prompts with PPO's sampling (40 new tokens).
TINY = ("device=cpu", "data.demo.n_pairs=100", "data.demo.n_sft=500", "data.demo.n_eval_prompts=16",
        "sft.model_size=tiny", "sft.vocab_size=1000", "sft.epochs=3", "sft.batch_size=16", "sft.micro_batch_size=16",
        "sft.learning_rate=3e-3", "sft.warmup_steps=10", "sft.eval_every=30", "sft.log_every=0",
        "eval.n_prompts=16", "ppo.generation.max_new_tokens=40", "ppo.generation.batch_size=16")


def tiny_config(*extra: str) -> PipelineConfig:
    return load_config(None, "tiny", [*TINY, *extra])


def demo_data(harness: StageHarness, config: PipelineConfig) -> Artifact:
    """The real data-prep stage on the generated demo task."""
    return harness.run(data_prep, "data-prep", data_prep.Config.of(config), data_prep.Inputs())


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageHarness]:
    harness = StageHarness(tmp_path_factory.mktemp("sft") / "state")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def data(harness: StageHarness) -> Artifact:
    return demo_data(harness, tiny_config())


@pytest.fixture(scope="module")
def tiny_run(harness: StageHarness, data: Artifact) -> Artifact:
    return harness.run(sft, "sft", sft.Config.of(tiny_config()), sft.Inputs(data))


def test_tiny_sft_lowers_the_heldout_loss_and_writes_the_curve(tiny_run: Artifact) -> None:
    result = sft.STAGE.result(tiny_run)
    m = result.metrics
    assert result.trained and not result.external and result.model == "model"
    assert abs(m["sft/initial_eval_loss"] - math.log(1000)) < 0.5  # untrained: about uniform over the vocabulary
    assert m["sft/final_eval_loss"] < 0.5 * m["sft/initial_eval_loss"]
    curve = json.loads(tiny_run.path(result.loss_curve).read_text())
    assert (curve["eval_losses"][0], curve["eval_losses"][-1]) == (m["sft/initial_eval_loss"], m["sft/final_eval_loss"])
    assert curve["eval_steps"][0] == 0 and curve["eval_steps"][-1] == len(curve["train_losses"]) == m["sft/steps"]
    assert tiny_run.path(result.loss_plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(tiny_run.path(result.metrics_file).read_text())
    assert saved == {"metrics": m, "trained": True, "base_model": None}
    assert tiny_run.record.config["sft"]["vocab_size"] == 1000 and tiny_run.record.config["gold_report_prompts"] == 16


def test_saved_folder_reloads_with_from_pretrained_and_generates(tiny_run: Artifact, data: Artifact) -> None:
    folder = sft.model_input(tiny_run).path
    assert folder == str(tiny_run.path("model"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert model.config.eos_token_id == tokenizer.eos_token_id
    # the saved weights are the trained ones: same held-out loss as the stage measured
    held_out = read_demonstrations(data.path(data.result["sft_eval"]))
    max_length = min(128, model.config.max_position_embeddings)  # as the stage cut it
    assert eval_loss(model, tokenizer, held_out, max_length) == pytest.approx(
        tiny_run.result["metrics"]["sft/final_eval_loss"], abs=1e-4)
    prompt = read_parquet(data.path(data.result["eval_prompts"]), EVAL_PROMPTS)[0]["prompt"]
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.shape[1] > ids.shape[1] and reply.strip()
    # the artifact holds exactly the files its record lists (no temporary or stale files beside them)
    on_disk = {p.relative_to(tiny_run.folder).as_posix() for p in tiny_run.folder.rglob("*") if p.is_file()}
    assert on_disk - {"record.json"} == set(tiny_run.record.files)


def test_gold_report_is_written_after_training(tiny_run: Artifact, data: Artifact) -> None:
    m = tiny_run.result["metrics"]
    assert m["sft_eval/gold_best"] >= 4.4 and m["sft_eval/correct_action_best"] == 1.0
    assert m["sft_eval/gold_best"] > m["sft_eval/gold_demonstrations"]
    for name in ("correct_action_greedy", "correct_action_sampled", "stopped_greedy", "stopped_sampled"):
        assert 0.0 <= m[f"sft_eval/{name}"] <= 1.0, name
    samples = json.loads(tiny_run.path(tiny_run.result["samples"]).read_text())
    eval_prompts = [r["prompt"] for r in read_parquet(data.path(data.result["eval_prompts"]), EVAL_PROMPTS)]
    assert [s["prompt"] for s in samples] == eval_prompts[:16]


def test_the_policy_is_registered_and_the_run_logged(tiny_run: Artifact, harness: StageHarness) -> None:
    entry = harness.active.stage("sft")
    assert entry.models == {"policy": f"models:/{harness.names.policy_model}/1"}
    version = MlflowClient().get_model_version(harness.names.policy_model, "1")
    assert version.tags["rlhf.role"] == "policy" and version.tags["rlhf.artifact_key"] == tiny_run.identity()
    run = harness.mlflow_run("sft")
    assert run.data.params["sft.vocab_size"] == "1000" and run.data.params["gold_report_prompts"] == "16"
    assert run.data.metrics["sft/final_eval_loss"] == tiny_run.result["metrics"]["sft/final_eval_loss"]
    logged = {Path(a.path).name for a in MlflowClient().list_artifacts(run.info.run_id, "sft")}
    assert logged == {"sft_loss.json", "sft_loss.png", "sft_eval_samples.json", "sft_metrics.json"}


def test_base_model_is_only_evaluated_unless_fine_tuning_is_asked(
    tiny_run: Artifact, data: Artifact, harness: StageHarness, caplog: pytest.LogCaptureFixture
) -> None:
    base = sft.model_input(tiny_run).path
    only = replace(sft.Config.of(tiny_config("sft.enabled=false", f"sft.base_model={base}")), gold_report_prompts=0)
    with caplog.at_level(logging.INFO, logger="tasks.sft"):
        loaded = harness.run(sft, "sft-eval-only", only, sft.Inputs(data))
    result = sft.STAGE.result(loaded)
    assert result.external and not result.trained and result.model == base and result.loss_curve is None
    assert sft.model_input(loaded).path == base and not loaded.path(".").joinpath("model").exists()
    assert result.metrics["sft/final_eval_loss"] == pytest.approx(
        tiny_run.result["metrics"]["sft/final_eval_loss"], abs=1e-4)
    assert "sft/final_eval_loss" in caplog.text
    tuned_cfg = replace(sft.Config.of(tiny_config(f"sft.base_model={base}", "sft.epochs=1", "sft.learning_rate=3e-4")),
                        gold_report_prompts=0)
    tuned = harness.run(sft, "sft-tuned", tuned_cfg, sft.Inputs(data))
    assert tuned.result["trained"] and sft.model_input(tuned).path == str(tuned.path("model"))
    assert tuned.result["metrics"]["sft/initial_eval_loss"] == pytest.approx(
        tiny_run.result["metrics"]["sft/final_eval_loss"], abs=1e-4)


def test_user_data_uses_the_base_model_as_it_is(tiny_run: Artifact, harness: StageHarness, tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "User: hi\nAssistant:", "chosen": " hello", "rejected": " go"}) + "\n")
    base = sft.model_input(tiny_run).path
    config = load_config(None, "tiny", ["device=cpu", "data.source=files", f"data.files=[{pairs}]",
                                        "refresh.enabled=false", f"sft.base_model={base}"])
    cfg = sft.Config.of(config)
    # no gold report on user data: its settings are not in the slice, so they cannot change the key
    assert (cfg.gold_report_prompts, cfg.generation) == (0, None)
    other = sft.Config.of(load_config(None, "tiny", ["device=cpu", "data.source=files", f"data.files=[{pairs}]",
                                                     "refresh.enabled=false", f"sft.base_model={base}",
                                                     "eval.n_prompts=3", "ppo.generation.max_new_tokens=5"]))
    assert stage_key("sft", cfg, {}) == stage_key("sft", other, {})
    demo = sft.Config.of(tiny_config())
    assert (demo.gold_report_prompts, demo.generation.max_new_tokens) == (16, 40)
    # user data brings no demonstrations: the base model is the policy, recorded where it is
    user_data = harness.artifact("data-prep", {}, {"sft_train": None, "sft_eval": None})
    art = harness.run(sft, "sft-user-data", cfg, sft.Inputs(user_data))
    result = sft.STAGE.result(art)
    assert (result.external, result.trained, result.model, result.metrics) == (True, False, base, {})
    assert sft.model_input(art).path == base
    assert json.loads(art.path(result.metrics_file).read_text()) == {"base_model": base}
    version = MlflowClient().get_model_version_by_alias(harness.names.policy_model, "candidate")
    assert harness.active.stage("sft-user-data").models == {"policy": f"models:/{harness.names.policy_model}/"
                                                                      f"{version.version}"}
    assert version.tags["rlhf.artifact_key"] == art.identity()
    with pytest.raises(ValueError, match="set sft.base_model"):
        harness.run(sft, "sft-user-data-no-base", replace(cfg, sft=replace(cfg.sft, base_model=None)),
                    sft.Inputs(user_data))


def test_special_tokens_set_in_the_config_travel_with_a_base_model_used_as_it_is(
        tiny_run: Artifact, data: Artifact, harness: StageHarness) -> None:
    """sft.tokens changes the tokenizer of a model used as it is: the model and that tokenizer are saved into the
    artifact (not recorded by path), so every later stage loads the same special tokens; its key differs."""
    base = sft.model_input(tiny_run).path
    plain = replace(sft.Config.of(tiny_config("sft.enabled=false", f"sft.base_model={base}")), gold_report_prompts=0)
    cfg = replace(sft.Config.of(tiny_config("sft.enabled=false", f"sft.base_model={base}",
                                            "sft.tokens.pad=<|bos|>")), gold_report_prompts=0)
    assert stage_key("sft", cfg, {}) != stage_key("sft", plain, {})
    art = harness.run(sft, "sft-tokens", cfg, sft.Inputs(data))
    result = sft.STAGE.result(art)
    assert (result.external, result.trained, result.model) == (False, False, "model")
    folder = sft.model_input(art).path
    assert folder == str(art.path("model"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|bos|>", "<|eos|>")
    weights = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert all(torch.equal(weights[name], original[name]) for name in original)
    unknown = replace(cfg, sft=replace(cfg.sft, tokens=replace(cfg.sft.tokens, pad="<|nope|>")))
    with pytest.raises(ValueError, match=r"sft.tokens.pad='<\|nope\|>' is not a token of"):
        harness.run(sft, "sft-tokens-unknown", unknown, sft.Inputs(data))


def test_an_encoder_is_refused_as_the_base_policy(data: Artifact, harness: StageHarness, tmp_path: Path) -> None:
    bert = model_families.save_policy("bert", tmp_path / "bert")
    cfg = replace(sft.Config.of(tiny_config("sft.enabled=false", f"sft.base_model={bert}")), gold_report_prompts=0)
    with pytest.raises(ValueError, match=r"BertLMHeadModel \(bidirectional encoder\) attends to later tokens; a "
                                         r"policy must be a causal LM") as info:
        harness.run(sft, "sft-encoder", cfg, sft.Inputs(data))
    assert "\n" not in str(info.value)


def test_bad_settings_name_the_fix(data: Artifact, harness: StageHarness, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        SFTSection(model_size="huge")  # type: ignore[arg-type]
    cfg = sft.Config.of(tiny_config(f"sft.base_model={tmp_path / 'missing'}"))
    with pytest.raises(ValueError, match="cannot be loaded .* local Hugging Face folder"):
        harness.run(sft, "sft-missing-base", cfg, sft.Inputs(data))
    assert harness.active.stage("sft-missing-base").status == "failed"


#: A 2-block GPT of width 96 with room for long replies: learns the intent -> action mapping in about 30 s.
SMALL_GPT = "sft.model_size={n_layer: 2, n_embd: 96, n_head: 4, n_positions: 128}"


@pytest.mark.slow
def test_sft_policy_learns_to_act_on_the_intent(tmp_path: Path) -> None:
    # the gold report samples up to 96 new tokens: room for the full replies this test judges
    config = load_config(None, "tiny", [
        "device=cpu", "data.demo.n_pairs=100", "data.demo.n_sft=1500", "data.demo.n_eval_prompts=64", SMALL_GPT,
        "sft.vocab_size=1000", "sft.epochs=4", "sft.batch_size=16", "sft.micro_batch_size=16",
        "sft.learning_rate=3e-3", "sft.warmup_steps=20", "sft.eval_every=0", "sft.log_every=0",
        "sft.eval_batch_size=64", "eval.n_prompts=64", "ppo.generation.max_new_tokens=96",
        "ppo.generation.temperature=1.0", "ppo.generation.batch_size=64"])
    harness = StageHarness(tmp_path / "state")
    try:
        art = harness.run(sft, "sft", sft.Config.of(config), sft.Inputs(demo_data(harness, config)))
    finally:
        harness.close()
    m = art.result["metrics"]
    assert m["sft/final_eval_loss"] < 0.15 * m["sft/initial_eval_loss"]
    assert m["sft_eval/correct_action_greedy"] >= 0.5  # the demonstrations themselves have about 0.5
    assert m["sft_eval/stopped_greedy"] >= 0.9
