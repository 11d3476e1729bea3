"""Annotators of rm-refresh: the reward-model judge, the per-pair adapter (simulated annotator) and on-policy
reply sampling, on tiny models."""

from __future__ import annotations


import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig
from rlhf_core.data import pair_id
from rlhf_core.demo import SimulatedAnnotator, gold_score, render_prompt
from rlhf_core.evaluation.annotators import (PerPairAnnotator, ReplyPair, RewardModelJudge, preference_pairs,
                                             sample_reply_pairs)
from rlhf_core.models.roles import sequence_scores
from rlhf_core.models.text import encode_pair
from rlhf_core.data.records import PreferencePair
from tests.tiny_models import gpt2_config, word_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

PAIRS = [ReplyPair("q cat", " good dog", " bad tree"), ReplyPair("q sun sat", " red", " blue big box"),
         ReplyPair("q why", " the mat", " a slow moon star"), ReplyPair("q how", " fast", " fast fast")]


@pytest.fixture(scope="module")
def judge() -> RewardModelJudge:
    tokenizer = word_tokenizer()
    torch.manual_seed(3)
    model = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    return RewardModelJudge(model, tokenizer, max_length=64, batch_size=3)


def _one_by_one(judge: RewardModelJudge, prompt: str, reply: str) -> float:
    """Loop reference: one unpadded sequence at a time."""
    ids = torch.tensor([encode_pair(judge.tokenizer, prompt, reply)])
    with torch.no_grad():
        return float(sequence_scores(judge.model, ids, torch.ones_like(ids)))


def test_reward_model_judge_prefers_the_higher_scoring_reply(judge: RewardModelJudge) -> None:
    a_scores, b_scores = judge.scores(PAIRS)  # batch_size 3: two padded batches
    expected_a = [_one_by_one(judge, p.prompt, p.reply_a) for p in PAIRS]
    expected_b = [_one_by_one(judge, p.prompt, p.reply_b) for p in PAIRS]
    assert a_scores.tolist() == pytest.approx(expected_a, abs=1e-5)
    assert b_scores.tolist() == pytest.approx(expected_b, abs=1e-5)
    assert judge.label(PAIRS) == [a >= b for a, b in zip(expected_a, expected_b)]
    assert len(set(judge.label(PAIRS))) == 2  # the random model is not constant: both answers occur
    swapped = [ReplyPair(p.prompt, p.reply_b, p.reply_a) for p in PAIRS]
    assert judge.label(swapped) == [not x for x in judge.label(PAIRS)]


def test_reward_model_judge_gives_ties_to_reply_a() -> None:
    tokenizer = word_tokenizer()
    model = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    torch.nn.init.zeros_(model.score.weight)  # every score is 0
    assert RewardModelJudge(model, tokenizer).label(PAIRS) == [True] * len(PAIRS)


def test_simulated_annotator_adapter_follows_gold_at_low_temperature() -> None:
    prompt = render_prompt("My lamp arrived broken.")
    good, bad = " I have emailed you a free return label.", " Check the website."
    assert gold_score(prompt, good) > gold_score(prompt, bad)
    annotator = PerPairAnnotator(SimulatedAnnotator(temperature=0.01, seed=0))
    pairs = [ReplyPair(prompt, good, bad), ReplyPair(prompt, bad, good)] * 3
    assert annotator.label(pairs) == [True, False] * 3
    noisy = [PerPairAnnotator(SimulatedAnnotator(temperature=5.0, seed=7)).label(pairs * 20) for _ in range(2)]
    assert noisy[0] == noisy[1] and 0 < sum(noisy[0]) < len(noisy[0])  # seeded, and noisy at a high temperature


def test_per_pair_adapter_refuses_answers_that_are_not_the_two_replies() -> None:
    class Rewriter:
        def label(self, prompt: str, reply_a: str, reply_b: str) -> tuple[str, str]:
            return reply_a.upper(), reply_b

    with pytest.raises(ValueError, match="Rewriter.label returned"):
        PerPairAnnotator(Rewriter()).label(PAIRS[:1])
    with pytest.raises(ValueError, match="identical replies"):
        PerPairAnnotator(SimulatedAnnotator()).label([ReplyPair("p", " x", " x")])


def test_preference_pairs_apply_labels_in_order_and_count_them() -> None:
    assert preference_pairs(PAIRS[:2], [True, False]) == [PreferencePair("q cat", " good dog", " bad tree"),
                                                         PreferencePair("q sun sat", " blue big box", " red")]
    with pytest.raises(ValueError, match="1 labels for 2 pairs"):
        preference_pairs(PAIRS[:2], [True])
    assert PAIRS[0].pair_id == pair_id("q cat", " good dog", " bad tree")


def test_sample_reply_pairs_is_on_policy_seeded_and_keeps_prompt_order() -> None:
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(gpt2_config(len(tokenizer)))
    prompts = ["q cat sat", "q dog", "q the red box", "q moon", "q star sun"]
    generation = GenerationConfig(max_new_tokens=8, batch_size=4)  # 2 prompts (4 rows) per batch
    pairs = sample_reply_pairs(policy, tokenizer, prompts, generation, seed=5)
    assert [p.prompt for p in pairs] == prompts
    assert pairs == sample_reply_pairs(policy, tokenizer, prompts, generation, seed=5)
    assert pairs != sample_reply_pairs(policy, tokenizer, prompts, generation, seed=6)
    assert sum(p.reply_a != p.reply_b for p in pairs) >= 4  # a random policy rarely repeats itself
    assert all(len(p.reply_a.split()) <= 8 and "<eos>" not in p.reply_a for p in pairs)
    with pytest.raises(ValueError, match="exceeds the policy's 64 positions"):
        sample_reply_pairs(policy, tokenizer, ["q " + "cat " * 60], generation, seed=0)
