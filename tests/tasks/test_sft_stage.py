"""The sft stage on the demo task: a tiny GPT learns the demonstrations, is saved as a Hugging Face directory
that reloads and generates, and is judged by gold after training."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.config import GenerationConfig
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.models.lm import ModelSize
from rlhf_core.training.sft import eval_loss
from tasks.config import SFTSection
from tasks.demo_data import EVAL_PROMPTS, DemoDataResult, run_demo_data_prep
from tasks.io import read_parquet
from tasks.sft import SFTStageResult, read_demonstrations, run_sft, save_pretrained_atomic, sft_task

TINY = SFTSection(model_size="tiny", vocab_size=1000, epochs=3, batch_size=16, micro_batch_size=16,
                  learning_rate=3e-3, warmup_steps=10, eval_every=30, log_every=0)
#: What the stage needs besides its section (the pipeline passes its seed, PPO's sampling and a prompt count).
EVAL = dict(seed=0, generation=GenerationConfig(max_new_tokens=40, batch_size=16), n_eval_prompts=16)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> DemoDataResult:
    return run_demo_data_prep(tmp_path_factory.mktemp("data"), DemoDataConfig(n_pairs=100, n_sft=500,
                                                                               n_eval_prompts=16))


@pytest.fixture(scope="module")
def tiny_run(data: DemoDataResult, tmp_path_factory: pytest.TempPathFactory) -> SFTStageResult:
    return run_sft(tmp_path_factory.mktemp("sft"), data.sft_train, data.sft_eval, TINY, **EVAL,
                   pairs_path=data.prep.train_pairs, eval_prompts_path=data.eval_prompts)


def test_tiny_sft_lowers_the_heldout_loss_and_writes_the_curve(tiny_run: SFTStageResult) -> None:
    m = tiny_run.metrics
    assert tiny_run.trained
    assert abs(m["sft/initial_eval_loss"] - math.log(1000)) < 0.5  # untrained: about uniform over the vocabulary
    assert m["sft/final_eval_loss"] < 0.5 * m["sft/initial_eval_loss"]
    curve = json.loads(Path(tiny_run.loss_curve_json).read_text())
    assert curve["eval_losses"][0] == m["sft/initial_eval_loss"] and curve["eval_losses"][-1] == m["sft/final_eval_loss"]
    assert curve["eval_steps"][0] == 0 and curve["eval_steps"][-1] == len(curve["train_losses"]) == m["sft/steps"]
    assert Path(tiny_run.loss_plot_png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(Path(tiny_run.metrics_json).read_text())
    assert saved["metrics"] == m and saved["model_dir"] == tiny_run.model_dir and saved["config"]["vocab_size"] == 1000


def test_saved_directory_reloads_with_from_pretrained_and_generates(tiny_run: SFTStageResult,
                                                                   data: DemoDataResult) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_run.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_run.model_dir)
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert model.config.eos_token_id == tokenizer.eos_token_id
    # the saved weights are the trained ones: same held-out loss as the stage measured
    held_out = read_demonstrations(data.sft_eval)
    max_length = min(TINY.max_length, model.config.max_position_embeddings)  # as the stage cut it
    assert eval_loss(model, tokenizer, held_out, max_length) == pytest.approx(
        tiny_run.metrics["sft/final_eval_loss"], abs=1e-4)
    prompt = read_parquet(data.eval_prompts, EVAL_PROMPTS)[0]["prompt"]
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.shape[1] > ids.shape[1] and reply.strip()
    assert not [p.name for p in Path(tiny_run.model_dir).parent.iterdir() if p.name.startswith(".model")]


def test_gold_report_is_written_after_training(tiny_run: SFTStageResult, data: DemoDataResult) -> None:
    m = tiny_run.metrics
    assert m["sft_eval/gold_best"] >= 4.4 and m["sft_eval/correct_action_best"] == 1.0
    assert m["sft_eval/gold_best"] > m["sft_eval/gold_demonstrations"]
    for name in ("correct_action_greedy", "correct_action_sampled", "stopped_greedy", "stopped_sampled"):
        assert 0.0 <= m[f"sft_eval/{name}"] <= 1.0, name
    samples = json.loads(Path(tiny_run.samples_json).read_text())
    eval_prompts = [r["prompt"] for r in read_parquet(data.eval_prompts, EVAL_PROMPTS)]
    assert [s["prompt"] for s in samples] == eval_prompts[: EVAL["n_eval_prompts"]]


def test_base_model_is_only_evaluated_unless_fine_tuning_is_asked(
    tiny_run: SFTStageResult, data: DemoDataResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = sft_task.fn(str(tmp_path / "eval_only"), data.sft_train, data.sft_eval,
                         replace(TINY, enabled=False, base_model=tiny_run.model_dir), **{**EVAL, "n_eval_prompts": 0})
    assert not loaded.trained and loaded.model_dir == tiny_run.model_dir and loaded.loss_curve_json is None
    assert loaded.metrics["sft/final_eval_loss"] == pytest.approx(tiny_run.metrics["sft/final_eval_loss"], abs=1e-4)
    assert "sft/final_eval_loss" in capsys.readouterr().out
    again = replace(TINY, base_model=tiny_run.model_dir, epochs=1, learning_rate=3e-4)
    tuned = run_sft(tmp_path / "tuned", data.sft_train, data.sft_eval, again, **{**EVAL, "n_eval_prompts": 0})
    assert tuned.trained and tuned.model_dir == str(tmp_path / "tuned" / "model")
    assert tuned.metrics["sft/initial_eval_loss"] == pytest.approx(tiny_run.metrics["sft/final_eval_loss"], abs=1e-4)


def test_saving_again_replaces_the_directory_whole(tiny_run: SFTStageResult, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_run.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_run.model_dir)
    target = tmp_path / "model"
    save_pretrained_atomic(model, tokenizer, target)
    (target / "stale.txt").write_text("from the earlier run")
    save_pretrained_atomic(model, tokenizer, target)
    assert (target / "config.json").exists() and not (target / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_bad_settings_name_the_fix(data: DemoDataResult, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        SFTSection(model_size="huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be loaded .* local Hugging Face directory"):
        run_sft(tmp_path, data.sft_train, data.sft_eval, replace(TINY, base_model=str(tmp_path / "missing")), **EVAL)


#: A 2-block GPT of width 96 with room for long replies: learns the intent -> action mapping in about 30 s.
SMALL_GPT = ModelSize(n_layer=2, n_embd=96, n_head=4, n_positions=128)


@pytest.mark.slow
def test_sft_policy_learns_to_act_on_the_intent(tmp_path: Path) -> None:
    data = run_demo_data_prep(tmp_path / "data", DemoDataConfig(n_pairs=100, n_sft=1500, n_eval_prompts=64))
    config = SFTSection(model_size=SMALL_GPT, vocab_size=1000, epochs=4, batch_size=16, micro_batch_size=16,
                        learning_rate=3e-3, warmup_steps=20, eval_every=0, log_every=0)
    # the gold report samples up to 96 new tokens: room for the full replies this test judges
    result = run_sft(tmp_path / "sft", data.sft_train, data.sft_eval, config, seed=0,
                     generation=GenerationConfig(max_new_tokens=96, temperature=1.0), n_eval_prompts=64,
                     eval_prompts_path=data.eval_prompts)
    m = result.metrics
    assert m["sft/final_eval_loss"] < 0.15 * m["sft/initial_eval_loss"]
    assert m["sft_eval/correct_action_greedy"] >= 0.5  # the demonstrations themselves have about 0.5
    assert m["sft_eval/stopped_greedy"] >= 0.9
