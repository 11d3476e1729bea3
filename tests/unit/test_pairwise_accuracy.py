"""One tie rule for every pairwise accuracy: a tie (s_chosen == s_rejected) is half right.

Reward-model training, its evaluation, the proxy/held-out agreement and the policy win rates all count through
``rlhf_core.ppo.pairwise.pairwise_wins``; hand-computed numbers with ties, and a loop reference.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2ForSequenceClassification

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.evaluation.metrics import pairwise_agreement, win_rate
from rlhf_core.ppo.pairwise import pairwise_accuracy, pairwise_wins
from rlhf_core.training.reward_training import encode_pairs, evaluate_reward_model, train_reward_model
from rlhf_core.data.records import PreferencePair
from tests.tiny_models import gpt2_config, word_tokenizer


def loop_accuracy(better: list[float], worse: list[float]) -> float:
    credit = 0.0
    for b, w in zip(better, worse, strict=True):
        credit += 1.0 if b > w else 0.5 if b == w else 0.0
    return credit / len(better)


def test_a_tie_is_half_right():
    chosen = torch.tensor([3.0, 1.0, 0.0, 5.0, 2.0])
    rejected = torch.tensor([1.0, 1.0, 2.0, 4.0, 2.0])
    assert pairwise_wins(chosen, rejected).tolist() == [1.0, 0.5, 0.0, 1.0, 0.5]
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(3 / 5)
    assert pairwise_accuracy(torch.zeros(4), torch.zeros(4)) == 0.5  # a constant scorer is at chance, not 0 or 1
    assert win_rate(chosen.tolist(), rejected.tolist()) == pytest.approx(3 / 5)  # the same rule


def test_pairwise_accuracy_matches_a_loop_on_many_ties():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 30)
        better = [float(rng.randint(0, 3)) for _ in range(n)]  # few values: many ties
        worse = [float(rng.randint(0, 3)) for _ in range(n)]
        assert pairwise_accuracy(torch.tensor(better), torch.tensor(worse)) == pytest.approx(loop_accuracy(better, worse))


def test_agreement_counts_a_pair_either_judge_ties_as_half():
    proxy = torch.tensor([1.0, -2.0, 0.0, 3.0, 0.0])
    heldout = torch.tensor([2.0, 1.0, 5.0, -1.0, 0.0])
    # same order, opposite, proxy ties, opposite, both tie
    assert pairwise_agreement(proxy, heldout) == pytest.approx((1 + 0 + 0.5 + 0 + 0.5) / 5)
    assert pairwise_agreement(heldout, proxy) == pairwise_agreement(proxy, heldout)


def test_pairwise_accuracy_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="equally long"):
        pairwise_accuracy(torch.zeros(3), torch.zeros(2))


def test_reward_training_and_evaluation_count_ties_alike():
    """A reward model whose score head is zero ties every pair: 0.5 in training and in evaluation (training used
    to count ties as wrong: 0.0)."""
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    with torch.no_grad():
        model.score.weight.zero_()
    pairs = [PreferencePair("hello", "good cat", "bad dog"), PreferencePair("why", "good sun", "bad moon")] * 2
    config = RewardTrainingConfig(epochs=1, batch_size=4, learning_rate=0.0, weight_decay=0.0)
    result = train_reward_model(model, tokenizer, pairs, pairs, config)
    assert result.train_accuracy == [0.5]
    assert result.final_eval.accuracy == 0.5
    assert evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, pairs, 32)).accuracy == 0.5
