"""PPO and reward-model training with LoRA adapters on tiny models: the reference stays the untouched base,
the first ratio is 1, the reward rises, resume is exact, and the saved models are plain Hugging Face models."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import (GenerationConfig, KLConfig, LoRAConfig, PPOConfig, RewardShapingConfig,
                              RewardTrainingConfig)
from rlhf_core.models.lora import LoRACritic, lora_layers, lora_policy
from rlhf_core.models.roles import ValueHead, load_reward_model, policy_forward
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo
from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training
from rlhf_core.training.reward_training import encode_pairs, evaluate_reward_model, train_reward_model
from tests.behaviour.test_reward_model_learns import planted_pairs
from tests.tiny_models import gpt2_config

PAD, BOS, EOS, TARGET, VOCAB = 0, 1, 2, 7, 24
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)


class CountTarget:
    """Programmatic reward: how many times the target token appears in the real response."""

    def __call__(self, rollout):
        return ((rollout.response_ids == TARGET) & rollout.response_mask).float().sum(dim=1)


def build(value_model: str = "head", seed: int = 0) -> tuple[PPOModels, GPT2LMHeadModel]:
    """LoRA PPO models and an untouched copy of the base policy."""
    torch.manual_seed(seed)
    base = GPT2LMHeadModel(gpt2_config(VOCAB))
    with torch.no_grad():
        # A LoRA adapter cannot touch the (tied) output embeddings, and at their random-init scale (std 0.02)
        # they cap every logit gap near 1; trained models have far larger ones. Stand in for that.
        base.transformer.wte.weight.mul_(4.0)
    untouched = copy.deepcopy(base)
    policy, reference = lora_policy(base, LORA)
    if value_model == "head":
        return PPOModels(policy, reference, CountTarget(), (EOS,), PAD, value_head=ValueHead(32)), untouched
    reward_model = GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1))
    critic = LoRACritic(reward_model, LORA)
    return PPOModels(policy, reference, CountTarget(), (EOS,), PAD, critic=critic), untouched


def prompts(n: int = 200) -> list[list[int]]:
    rng = random.Random(0)
    return [[BOS] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))] for _ in range(n)]


def config(**overrides) -> PPOConfig:
    settings = dict(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=8, ppo_epochs=2, learning_rate=1e-2,
                    value_learning_rate=1e-2, lora=LORA, generation=GenerationConfig(max_new_tokens=8, batch_size=16))
    settings.update(overrides)
    return PPOConfig(**settings)


def run_steps(models: PPOModels, cfg: PPOConfig, n: int) -> list:
    models, strategy = prepare_training(models, cfg)
    state = PPOState(make_kl_controller(cfg), torch.Generator().manual_seed(0))
    return [ppo_step(models, strategy, state, prompts(cfg.rollout_batch_size), cfg) for _ in range(n)]


def response_logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[PAD, BOS, 5, 6, 7, 8, 9, EOS], [BOS, 3, 4, 7, 7, 7, 10, EOS]])
    mask = (ids != PAD).long()
    with torch.no_grad():
        return policy_forward(model, ids, mask, query_len=3, temperature=1.0).logprobs


@pytest.mark.parametrize("value_model", ["head", "critic"])
def test_first_ratio_is_one_and_only_adapters_and_value_model_train(value_model: str):
    models, _ = build(value_model)
    _, strategy = prepare_training(models, config())
    policy_params = strategy.optimizer.param_groups[0]["params"]
    names = {id(p): n for n, p in models.policy.named_parameters()}
    assert policy_params and all("lora_" in names[id(p)] for p in policy_params)
    n_base = sum(p.numel() for p in models.policy.parameters() if not p.requires_grad)
    assert sum(p.numel() for p in policy_params) < 0.2 * n_base
    stats = run_steps(models, config(ppo_epochs=1, mini_batch_size=16, micro_batch_size=8), 1)[0]
    assert stats.update.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert stats.update.approx_kl == pytest.approx(0.0, abs=1e-10)
    assert stats.rollout.kl_mean == pytest.approx(0.0, abs=1e-6)  # adapter B = 0: policy == reference


def test_reference_stays_the_untouched_base_while_the_adapter_learns():
    models, untouched = build()
    before = response_logprobs(models.policy)
    run_steps(models, config(), 3)
    assert not torch.allclose(response_logprobs(models.policy), before, atol=1e-3)  # the adapter moved
    assert torch.equal(response_logprobs(models.reference), response_logprobs(untouched))


@pytest.mark.slow
def test_lora_ppo_raises_a_programmatic_reward():
    models, _ = build()
    cfg = config(rollout_batch_size=32, mini_batch_size=16, micro_batch_size=16, learning_rate=1e-2,
                 kl=KLConfig(coef=0.2), generation=GenerationConfig(max_new_tokens=8, batch_size=32))
    history = train_ppo(models, prompts(), cfg, 25).history
    start = history[0]["ppo/scores/mean"]
    end = sum(h["ppo/scores/mean"] for h in history[-5:]) / 5
    kl = sum(h["ppo/kl/mean"] for h in history[-5:]) / 5
    print(f"LoRA PPO: score {start:.2f} -> {end:.2f}, KL {kl:.2f}")
    # 8 new tokens: ~0.2 target tokens at the start, 8 at best. Full fine-tuning (test_ppo_learns.py) gains
    # > 2.5 in 25 updates; the adapter over frozen embeddings gains ~2 here.
    assert end > start + 1.5
    assert 0.5 < kl < 16.0


def resume_config(refresh: int) -> PPOConfig:
    return config(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=4, learning_rate=3e-3,
                  value_learning_rate=3e-3, lr_schedule="linear", total_updates=6, ref_refresh_every=refresh,
                  kl=KLConfig(coef=0.05, adaptive=True, target=2.0, horizon=100.0),
                  reward=RewardShapingConfig(normalize=True),
                  generation=GenerationConfig(max_new_tokens=8, batch_size=8))


@pytest.mark.slow
@pytest.mark.parametrize(("value_model", "refresh"), [("head", 0), ("critic", 0), ("head", 3)])
def test_lora_resume_reproduces_the_uninterrupted_run(tmp_path: Path, value_model: str, refresh: int):
    cfg = resume_config(refresh)
    straight, _ = build(value_model)
    expected = train_ppo(straight, prompts(40), cfg, 6).history

    train_ppo(build(value_model)[0], prompts(40), cfg, 4, checkpoint_dir=tmp_path, checkpoint_every=2)
    resumed, _ = build(value_model)
    result = train_ppo(resumed, prompts(40), cfg, 6, checkpoint_dir=tmp_path, checkpoint_every=2)

    assert result.resumed_from_step == 4
    for key in ("ppo/scores/mean", "ppo/policy/loss", "ppo/value/loss", "ppo/kl/coef"):
        assert [h[key] for h in result.history] == [h[key] for h in expected], key
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(response_logprobs(straight.reference), response_logprobs(resumed.reference))
    saved = load_file(str(latest_checkpoint(tmp_path) / "policy.safetensors"))
    if refresh:  # refreshes rewrite the base weights, so the whole policy is stored
        assert any("base_layer" in key for key in saved)
    else:  # only the adapter: the base is the SFT model the run starts from
        assert saved and all("lora_" in key for key in saved)


def test_lora_refresh_moves_the_reference_to_the_policy():
    models, untouched = build()
    run_steps(models, config(ref_refresh_every=2), 2)
    torch.testing.assert_close(response_logprobs(models.reference), response_logprobs(models.policy),
                               rtol=0, atol=1e-5)
    assert not torch.allclose(response_logprobs(models.reference), response_logprobs(untouched), atol=1e-3)
    assert all(not layer.lora_B["default"].weight.any() for layer in lora_layers(models.policy))


def test_lora_reward_model_learns_and_comes_back_plain(tiny_reward_dir, tokenizer):
    model = load_reward_model(str(tiny_reward_dir))
    embeddings = model.transformer.wte.weight.detach().clone()
    train, held_out = planted_pairs(400, seed=0), planted_pairs(200, seed=1)
    before = evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, held_out, 64))
    lora = LoRAConfig(enabled=True, rank=8, alpha=16.0, dropout=0.05)
    result = train_reward_model(model, tokenizer, train, held_out, RewardTrainingConfig(
        epochs=3, batch_size=16, learning_rate=3e-3, max_length=64, lora=lora))
    after = result.final_eval
    print(f"LoRA RM held-out accuracy {before.accuracy:.3f} -> {after.accuracy:.3f}")
    assert after.accuracy >= 0.9 and after.loss < before.loss
    assert type(model) is GPT2ForSequenceClassification and not list(lora_layers(model))
    assert torch.equal(model.transformer.wte.weight, embeddings)  # frozen under LoRA
    assert all(p.requires_grad for p in model.parameters())
    merged = evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, held_out, 64))
    assert merged.accuracy == pytest.approx(after.accuracy, abs=0.01)
