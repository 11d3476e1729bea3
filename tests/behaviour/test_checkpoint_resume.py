"""A PPO run stopped and resumed from its checkpoint ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig, RewardShapingConfig
from rlhf_core.models.roles import Critic, ValueHead, disable_dropout, make_reference
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo
from tests.tiny_models import gpt2_config

PAD, BOS, EOS, VOCAB = 0, 1, 2, 24


class CountSeven:
    def __call__(self, rollout):
        return ((rollout.response_ids == 7) & rollout.response_mask).float().sum(dim=1)


def build(value_model: str) -> PPOModels:
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
    if value_model == "head":
        return PPOModels(policy, make_reference(policy), CountSeven(), (EOS,), PAD, value_head=ValueHead(32))
    critic = Critic(GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1)))
    return PPOModels(policy, make_reference(policy), CountSeven(), (EOS,), PAD, critic=critic)


def config(**overrides) -> PPOConfig:
    settings = dict(
        rollout_batch_size=16, mini_batch_size=8, micro_batch_size=4, ppo_epochs=2, learning_rate=3e-3,
        value_learning_rate=3e-3, lr_schedule="linear", total_updates=6, ref_refresh_every=3,
        kl=KLConfig(coef=0.05, adaptive=True, target=2.0, horizon=100.0),
        reward=RewardShapingConfig(normalize=True), generation=GenerationConfig(max_new_tokens=8, batch_size=8),
    )
    settings.update(overrides)
    return PPOConfig(**settings)


PROMPTS = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(1 + i % 4)] for i in range(40)]


@pytest.mark.parametrize("value_model", ["head", "critic"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, value_model: str):
    straight = build(value_model)
    expected = train_ppo(straight, PROMPTS, config(), 6).history

    first = build(value_model)
    train_ppo(first, PROMPTS, config(), 4, checkpoint_dir=tmp_path, checkpoint_every=2)
    assert latest_checkpoint(tmp_path).name == "step_000004"
    resumed = build(value_model)  # a fresh process would rebuild from the same initial weights
    result = train_ppo(resumed, PROMPTS, config(), 6, checkpoint_dir=tmp_path, checkpoint_every=2)

    assert result.resumed_from_step == 4
    assert [h["ppo/kl/coef"] for h in result.history] == [h["ppo/kl/coef"] for h in expected]
    assert [h["ppo/scores/mean"] for h in result.history] == [h["ppo/scores/mean"] for h in expected]
    assert [h["ppo/policy/loss"] for h in result.history] == [h["ppo/policy/loss"] for h in expected]
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.reference.parameters(), resumed.reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoints_are_pickle_free_atomic_and_pruned(tmp_path: Path):
    train_ppo(build("head"), PROMPTS, config(ref_refresh_every=0), 6, checkpoint_dir=tmp_path, checkpoint_every=2)
    steps = sorted(p.name for p in tmp_path.glob("step_*"))
    assert steps == ["step_000004", "step_000006"]  # keep=2
    files = {p.name for p in (tmp_path / "step_000006").iterdir()}
    assert files == {"policy.safetensors", "value.safetensors", "optimizer.safetensors", "optimizer.json",
                     "rng.safetensors", "state.json", "manifest.json"}
    assert not list(tmp_path.glob(".tmp-*"))
    # A half-written checkpoint (killed mid-save) is never picked up: only `latest` counts.
    (tmp_path / ".tmp-step_000008-x").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_000006"


def test_resume_refuses_a_different_prompt_table(tmp_path: Path):
    train_ppo(build("head"), PROMPTS, config(ref_refresh_every=0), 2, checkpoint_dir=tmp_path, checkpoint_every=2)
    with pytest.raises(ValueError, match="resume with the same inputs"):
        train_ppo(build("head"), PROMPTS[:30], config(ref_refresh_every=0), 4, checkpoint_dir=tmp_path, checkpoint_every=2)
