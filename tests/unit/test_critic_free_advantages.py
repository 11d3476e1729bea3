"""GRPO, RLOO and REINFORCE++ advantages against hand-computed numbers, and the settings they refuse."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig
from rlhf_core.models.sequences import Rollout
from rlhf_core.ppo.advantages import baseline_scores, returns_to_go
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.training.experience import build_experience


def test_grpo_divides_by_the_groups_sample_std() -> None:
    # groups (1, 3) and (2, 2): means 2 and 2; stds sqrt(2) (Bessel) and 0
    adjusted = baseline_scores(torch.tensor([1.0, 3.0, 2.0, 2.0]), "grpo", 2)
    assert adjusted.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0], abs=1e-5)


def test_dr_grpo_only_centres() -> None:
    adjusted = baseline_scores(torch.tensor([1.0, 3.0, 2.0, 2.0]), "grpo", 2, scale_by_std=False)
    assert adjusted.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])


def test_rloo_subtracts_the_mean_of_the_other_replies() -> None:
    # 1 - (2 + 6) / 2 = -3; 2 - (1 + 6) / 2 = -1.5; 6 - (1 + 2) / 2 = 4.5
    adjusted = baseline_scores(torch.tensor([1.0, 2.0, 6.0]), "rloo", 3)
    assert adjusted.tolist() == pytest.approx([-3.0, -1.5, 4.5])


def test_reinforce_pp_keeps_the_score() -> None:
    assert baseline_scores(torch.tensor([1.0, -2.0, 5.0]), "reinforce_pp", 1).tolist() == [1.0, -2.0, 5.0]


def test_groups_must_be_whole() -> None:
    with pytest.raises(ValueError, match="whole groups"):
        baseline_scores(torch.tensor([1.0, 2.0, 3.0]), "grpo", 2)


def test_returns_to_go_by_hand_and_masked() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    # gamma 0.5: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
    assert returns_to_go(rewards, mask, 0.5).tolist() == [[2.75, 3.5, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]]


def _rollout(mask: torch.Tensor) -> Rollout:
    b, t = mask.shape
    return Rollout(torch.ones(b, 1, dtype=torch.long), torch.ones(b, 1, dtype=torch.bool),
                   torch.full((b, t), 5), mask, torch.zeros(b, t), torch.ones(b, dtype=torch.bool))


def _config(**overrides) -> PPOConfig:
    settings = dict(rollout_batch_size=2, mini_batch_size=2, micro_batch_size=2, samples_per_prompt=2,
                    whiten_advantages=False, generation=GenerationConfig(max_new_tokens=2, batch_size=2),
                    kl=KLConfig(coef=0.5))
    return PPOConfig(**{**settings, **overrides})


def test_grpo_experience_by_hand_with_the_kl_penalty_in_the_reward() -> None:
    """Scores (1, 3) -> -+1/sqrt(2) on the last token; k1 KL (0.1, 0.2), (0.0, 0.4) at coef 0.5 on every token;
    the advantage of a token is the sum of the rewards from it on."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    ref = torch.zeros(2, 2)
    old = torch.tensor([[0.1, 0.2], [0.0, 0.4]])
    experience, stats = build_experience(_rollout(mask), old, ref, torch.zeros(2, 2), torch.tensor([1.0, 3.0]),
                                         _config(advantage="grpo"), 0.5, RunningMoments())
    s = 1 / math.sqrt(2)
    expected = [[-0.05 - 0.1 - s, -0.1 - s], [0.0 - 0.2 + s, -0.2 + s]]
    assert experience.advantages.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    assert torch.equal(experience.returns, experience.advantages)
    # the reward statistic keeps the plain score: mean of (1 - 0.15, 3 - 0.2)
    assert stats.reward_mean == pytest.approx((0.85 + 2.8) / 2, abs=1e-6)


def test_rloo_experience_with_the_kl_in_the_loss_has_no_penalty_in_the_advantage() -> None:
    mask = torch.tensor([[True, True], [True, False]])
    experience, _ = build_experience(_rollout(mask), torch.full((2, 2), 0.3), torch.zeros(2, 2), torch.zeros(2, 2),
                                     torch.tensor([1.0, 3.0]),
                                     _config(advantage="rloo", kl=KLConfig(coef=0.5, placement="loss",
                                                                           estimator="k3")), 0.5, RunningMoments())
    assert experience.advantages.tolist() == [[-2.0, -2.0], [2.0, 0.0]]


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(advantage="grpo", samples_per_prompt=1), "ppo.advantage=grpo compares the replies to one prompt"),
    (dict(advantage="rloo", samples_per_prompt=1), "set ppo.samples_per_prompt >= 2"),
    (dict(samples_per_prompt=3), "ppo.samples_per_prompt (3) must divide ppo.rollout_batch_size (2)"),
    (dict(advantage="reinforce_pp", samples_per_prompt=1, rollout_batch_size=8, mini_batch_size=8, micro_batch_size=8),
     "reinforce_pp whitens its returns"),
])
def test_settings_an_estimator_cannot_use_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**overrides)


def test_k1_in_the_loss_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="k1 with ppo.kl.placement=loss") as info:
        KLConfig(placement="loss")
    assert "\n" not in str(info.value) and "ppo.kl.estimator=k3" in str(info.value)


def test_prompts_per_update_and_value_model_use() -> None:
    config = _config(advantage="grpo", rollout_batch_size=8, mini_batch_size=8, micro_batch_size=8,
                     samples_per_prompt=4)
    assert config.prompts_per_update == 2 and not config.uses_value_model
    assert PPOConfig().uses_value_model and PPOConfig().prompts_per_update == PPOConfig().rollout_batch_size
