"""Score-normalisation moments restart when the reward model changes.

An iteration continues the previous one's checkpoint, moments included; after a promoted refresh the new reward
model scores on its own scale, so moments estimated with the old one would shift and scale its scores wrongly.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, PPOConfig, RewardShapingConfig
from rlhf_core.models.roles import ValueHead, disable_dropout, make_reference
from rlhf_core.models.scoring import RewardModelScorer, WeightedSum, scorer_identity
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import restore_score_moments, train_ppo
from tests.tiny_models import gpt2_config, word_tokenizer

PAD, BOS, EOS, VOCAB = 0, 1, 2, 24
PROMPTS = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(1 + i % 3)] for i in range(32)]


class NormalScores:
    """Scores ~ N(mean, std) drawn from its own generator, whatever the replies; ``identity`` names the model."""

    def __init__(self, name: str, mean: float, std: float) -> None:
        self.name, self.mean, self.std = name, mean, std
        self.generator = torch.Generator().manual_seed(int(mean * 100 + std))

    def __call__(self, rollout) -> torch.Tensor:
        return self.mean + self.std * torch.randn(rollout.query_ids.shape[0], generator=self.generator)

    def identity(self) -> str:
        return self.name


def models(scorer) -> PPOModels:
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
    return PPOModels(policy, make_reference(policy), scorer, (EOS,), PAD, value_head=ValueHead(32))


CONFIG = PPOConfig(rollout_batch_size=16, mini_batch_size=16, micro_batch_size=8, ppo_epochs=1,
                   reward=RewardShapingConfig(normalize=True), generation=GenerationConfig(max_new_tokens=4, batch_size=16))


def continue_with(tmp_path: Path, scorer, steps_before: int = 5) -> list[dict[str, float]]:
    """``steps_before`` updates scored by RM A ~ N(0, 1), then one more from that checkpoint scored by ``scorer``."""
    train_ppo(models(NormalScores("A", 0.0, 1.0)), PROMPTS, CONFIG, steps_before, checkpoint_dir=tmp_path / "one")
    return train_ppo(models(scorer), PROMPTS, CONFIG, steps_before + 1, checkpoint_dir=tmp_path / "two",
                     init_from=latest_checkpoint(tmp_path / "one")).history


def test_a_new_reward_model_normalises_from_its_first_batch(tmp_path: Path):
    last = continue_with(tmp_path, NormalScores("B", 5.0, 3.0))[-1]
    assert last["ppo/scores/raw_mean"] == pytest.approx(5.0, abs=1.5)
    assert last["ppo/scores/mean"] == pytest.approx(0.0, abs=1e-5)  # the moments restarted on B's own batch
    assert last["ppo/scores/std"] == pytest.approx(1.0, abs=0.05)


def test_the_same_reward_model_keeps_its_moments(tmp_path: Path):
    """Same identity, same moments: B's scores under A's name are normalised with A's statistics (far from 0)."""
    last = continue_with(tmp_path, NormalScores("A", 5.0, 3.0))[-1]
    assert last["ppo/scores/mean"] > 1.0


def test_restore_score_moments_by_identity():
    old = RunningMoments()
    for seed in range(10):  # RM A ~ N(0, 1)
        old.update(torch.randn(64, generator=torch.Generator().manual_seed(seed)))
    saved = {"score_moments": old.state_dict(), "score_moments_scorer": "A"}
    new_scores = 5.0 + 3.0 * torch.randn(64, generator=torch.Generator().manual_seed(99))  # RM B ~ N(5, 3)

    def first_batch_mean(scorer: str | None, saved: dict) -> float:
        moments = RunningMoments()
        restore_score_moments(saved, moments, scorer)
        moments.update(new_scores)
        return float(moments.normalise(new_scores).mean())

    assert first_batch_mean("B", saved) == pytest.approx(0.0, abs=1e-6)
    assert first_batch_mean("A", saved) > 0.5  # kept: the old moments drag the mean far from 0
    assert first_batch_mean(None, saved) > 0.5  # a scorer without an identity keeps them, as before
    assert first_batch_mean("B", {"score_moments": old.state_dict()}) > 0.5  # a checkpoint without a record too


def test_a_reward_model_scorer_is_identified_by_its_weights():
    tokenizer = word_tokenizer()
    torch.manual_seed(1)
    rm = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    same = copy.deepcopy(rm)
    refreshed = copy.deepcopy(rm)
    with torch.no_grad():
        refreshed.score.weight.add_(1e-3)  # a retrained head (a refresh always trains it)
    identity = scorer_identity(RewardModelScorer(rm, tokenizer))
    assert identity == scorer_identity(RewardModelScorer(same, tokenizer))
    assert identity != scorer_identity(RewardModelScorer(refreshed, tokenizer))
    assert identity != scorer_identity(RewardModelScorer(copy.deepcopy(rm).bfloat16(), tokenizer))
    assert scorer_identity(WeightedSum([(RewardModelScorer(rm, tokenizer), 1.0)])) is not None
    assert scorer_identity(WeightedSum([(RewardModelScorer(rm, tokenizer), 1.0), (lambda r: r, 0.5)])) is None
    assert scorer_identity(lambda rollout: rollout) is None
