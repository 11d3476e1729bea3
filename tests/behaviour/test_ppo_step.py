"""Invariants of one PPO step on a tiny model, asserted from the step's own statistics."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig, RewardShapingConfig
from rlhf_core.models.roles import ValueHead, disable_dropout, load_policy, make_reference
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.training.experience import PPOModels, collect_experience
from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training
from tests.tiny_models import gpt2_config

PAD, BOS, EOS, VOCAB = 0, 1, 2, 24


class CountSeven:
    def __call__(self, rollout):
        return ((rollout.response_ids == 7) & rollout.response_mask).float().sum(dim=1)


def models() -> PPOModels:
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
    return PPOModels(policy, make_reference(policy), CountSeven(), (EOS,), PAD, value_head=ValueHead(32))


PROMPTS = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(2 + i % 3)] for i in range(16)]


def step(config: PPOConfig, m: PPOModels | None = None):
    m = m or models()
    m, strategy = prepare_training(m, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    return ppo_step(m, strategy, state, PROMPTS, config), state


def base(**overrides) -> PPOConfig:
    settings = dict(rollout_batch_size=16, mini_batch_size=16, micro_batch_size=8, ppo_epochs=1,
                    generation=GenerationConfig(max_new_tokens=8, temperature=0.7, batch_size=16))
    settings.update(overrides)
    return PPOConfig(**settings)


def test_first_minibatch_ratio_is_exactly_one():
    """Old log-probs are recomputed the way the update computes them (same temperature, no dropout)."""
    stats, _ = step(base())
    assert stats.update.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert stats.update.clipfrac == 0.0
    assert stats.update.approx_kl == pytest.approx(0.0, abs=1e-10)
    # At step 0 the policy IS the reference: the per-sequence KL is 0 and the reward is the score.
    assert stats.rollout.kl_mean == pytest.approx(0.0, abs=1e-6)
    assert stats.rollout.reward_mean == pytest.approx(stats.rollout.score_mean, abs=1e-6)


def test_kl_in_the_loss_keeps_it_out_of_the_reward():
    m = models()
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))  # policy != reference, so the KL is not 0
    config = base(kl=KLConfig(coef=0.5, placement="loss", estimator="k3"))
    experience, stats, _, _ = collect_experience(m, PROMPTS, config, 0.5, torch.Generator().manual_seed(0), RunningMoments())
    assert stats.kl_k3_mean > 0.01
    assert stats.reward_mean == pytest.approx(stats.score_mean, abs=1e-6)
    in_reward = base(kl=KLConfig(coef=0.5))
    _, stats_r, _, _ = collect_experience(m, PROMPTS, in_reward, 0.5, torch.Generator().manual_seed(0), RunningMoments())
    assert stats_r.reward_mean == pytest.approx(stats_r.score_mean - 0.5 * stats_r.kl_mean, abs=1e-4)


def test_sequence_advantage_is_constant_along_each_response():
    m = models()
    config = base(advantage="sequence", whiten_advantages=False)
    experience, _, _, _ = collect_experience(m, PROMPTS, config, 0.05, torch.Generator().manual_seed(1), RunningMoments())
    mask = experience.rollout.response_mask
    for row in range(mask.shape[0]):
        values = experience.advantages[row][mask[row]]
        assert torch.allclose(values, values[0].expand_as(values))


def test_missing_stop_penalty_replaces_scores_of_truncated_responses():
    m = models()
    config = base(reward=RewardShapingConfig(missing_stop_penalty=-3.0))
    experience, _, _, _ = collect_experience(m, PROMPTS, config, 0.05, torch.Generator().manual_seed(0), RunningMoments())
    truncated = ~experience.rollout.stopped
    assert truncated.any()
    assert (experience.scores[truncated] == -3.0).all()


def test_dropout_is_off_in_a_loaded_policy(tmp_path):
    GPT2LMHeadModel(gpt2_config(VOCAB, resid_pdrop=0.5, attn_pdrop=0.5, embd_pdrop=0.5)).save_pretrained(tmp_path)
    policy = load_policy(str(tmp_path)).train()
    ids = torch.tensor([[BOS, 5, 6, 7]])
    assert torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)


def test_adaptive_controller_moves_kl_coef_and_reference_refresh_resets_kl():
    config = base(ppo_epochs=4, learning_rate=5e-3, kl=KLConfig(coef=0.1, adaptive=True, target=0.01, horizon=50),
                  ref_refresh_every=1)
    m = models()
    stats, state = step(config, m)
    # KL at step 0 is 0 < target: the coefficient shrinks by the full 20% * 16 / 50.
    assert state.kl_controller.coef == pytest.approx(0.1 * (1 - 0.2 * 16 / 50))
    for a, b in zip(m.policy.parameters(), m.reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_wrong_prompt_count_is_refused():
    with pytest.raises(ValueError, match="rollout_batch_size"):
        m = models()
        m, strategy = prepare_training(m, base())
        ppo_step(m, strategy, PPOState(make_kl_controller(base()), torch.Generator()), PROMPTS[:5], base())


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("value_model", ["head", "critic"])
def test_critic_warmup_trains_the_value_model_alone_then_the_policy(value_model: str):
    """ppo.critic_warmup_updates=1: the first update leaves every policy weight and the policy's optimizer state as
    they were (a value head reads the policy detached) while the value model moves; the second moves the policy."""
    from rlhf_core.models.roles import Critic

    m = models()
    if value_model == "critic":
        from transformers import GPT2ForSequenceClassification
        torch.manual_seed(1)
        critic = Critic(GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1)))
        m = PPOModels(m.policy, m.reference, m.scorer, m.stop_token_ids, m.pad_token_id, critic=critic)
    config = base(critic_warmup_updates=1, ppo_epochs=2, learning_rate=1e-3, value_learning_rate=1e-3)
    m, strategy = prepare_training(m, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    policy_before, value_before = _weights(m.policy), _weights(m.value_model)
    first = ppo_step(m, strategy, state, PROMPTS, config)
    assert all(torch.equal(policy_before[k], v) for k, v in _weights(m.policy).items())
    assert any(not torch.equal(value_before[k], v) for k, v in _weights(m.value_model).items())
    policy_params = set(map(id, m.policy.parameters()))
    assert not any(id(p) in policy_params for p in strategy.optimizer.state)  # no moments, no step count for the policy
    assert first.update.critic_warmup == 1.0 and first.update.policy_grad_norm == 0.0
    assert first.update.value_grad_norm > 0
    second = ppo_step(m, strategy, state, PROMPTS, config)
    assert any(not torch.equal(policy_before[k], v) for k, v in _weights(m.policy).items())
    assert second.update.critic_warmup == 0.0 and second.update.policy_grad_norm > 0
