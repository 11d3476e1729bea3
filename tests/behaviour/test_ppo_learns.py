"""PPO raises a known programmatic reward while the KL leash holds; a larger KL coefficient drifts less."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig
from rlhf_core.models.roles import ValueHead, disable_dropout, make_reference
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo
from tests.tiny_models import gpt2_config

PAD, BOS, EOS, TARGET, VOCAB = 0, 1, 2, 7, 24


class CountTarget:
    """Programmatic reward: how many times the target token appears in the real response."""

    def __call__(self, rollout):
        return ((rollout.response_ids == TARGET) & rollout.response_mask).float().sum(dim=1)


def build_models() -> PPOModels:
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
    return PPOModels(policy, make_reference(policy), CountTarget(), (EOS,), PAD, value_head=ValueHead(32))


def prompts(n: int = 200) -> list[list[int]]:
    rng = random.Random(0)
    return [[BOS] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))] for _ in range(n)]


def run(kl_coef: float, steps: int = 25) -> list[dict[str, float]]:
    config = PPOConfig(
        rollout_batch_size=32, mini_batch_size=16, micro_batch_size=16, ppo_epochs=2,
        learning_rate=1e-3, value_learning_rate=1e-3, kl=KLConfig(coef=kl_coef),
        generation=GenerationConfig(max_new_tokens=8, batch_size=32),
    )
    return train_ppo(build_models(), prompts(), config, steps).history


def mean_last(history: list[dict[str, float]], key: str, n: int = 5) -> float:
    return sum(h[key] for h in history[-n:]) / n


@pytest.mark.slow
def test_ppo_raises_reward_and_larger_kl_coef_drifts_less():
    loose, tight = run(kl_coef=0.2), run(kl_coef=2.0)
    start = loose[0]["ppo/scores/mean"]
    loose_score, loose_kl = mean_last(loose, "ppo/scores/mean"), mean_last(loose, "ppo/kl/mean")
    tight_kl = mean_last(tight, "ppo/kl/mean")
    print(f"score {start:.2f} -> {loose_score:.2f}; KL kl_coef=0.2: {loose_kl:.2f}, kl_coef=2.0: {tight_kl:.2f}")
    # 8 new tokens, uniform-ish start: ~0.4 target tokens; the best possible response has 8.
    assert loose_score > start + 2.5
    # Bounded: far below the ~8 * log(21) = 24 nats of a policy collapsed onto one token.
    assert 0.5 < loose_kl < 16.0
    assert max(h["ppo/kl/mean"] for h in loose) < 20.0
    assert tight_kl < 0.25 * loose_kl
    # The metrics a user reads are all present and finite.
    assert all(torch.isfinite(torch.tensor(list(h.values()))).all() for h in loose)
