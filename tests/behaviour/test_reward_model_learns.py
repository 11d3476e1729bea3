"""A tiny reward model learns a planted preference rule from pairs (measured held-out accuracy)."""

from __future__ import annotations

import random

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.models import load_reward_model
from rlhf_core.reward_training import PreferencePair, encode_pairs, evaluate_reward_model, train_reward_model

FILLER = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "red", "blue", "big", "small", "tree", "box"]


def planted_pairs(n: int, seed: int) -> list[PreferencePair]:
    """Rule: a reply is better the more 'good' and the fewer 'bad' words it has (never tied)."""
    rng = random.Random(seed)

    def reply(n_good: int, n_bad: int) -> str:
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 7))] + ["good"] * n_good + ["bad"] * n_bad
        rng.shuffle(words)
        return " " + " ".join(words)

    pairs = []
    for _ in range(n):
        a, b = rng.sample([(g, x) for g in range(3) for x in range(3)], 2)
        while a[0] - a[1] == b[0] - b[1]:
            a, b = rng.sample([(g, x) for g in range(3) for x in range(3)], 2)
        better, worse = (a, b) if a[0] - a[1] > b[0] - b[1] else (b, a)
        prompt = "q " + " ".join(rng.choice(FILLER) for _ in range(3))
        pairs.append(PreferencePair(prompt, reply(*better), reply(*worse)))
    return pairs


def test_reward_model_learns_planted_rule(tiny_reward_dir, tokenizer):
    model = load_reward_model(str(tiny_reward_dir))
    train, held_out = planted_pairs(800, seed=0), planted_pairs(200, seed=1)
    before = evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, held_out, 64))
    logged = []
    result = train_reward_model(
        model, tokenizer, train, held_out,
        RewardTrainingConfig(epochs=3, batch_size=16, learning_rate=3e-3, max_length=64),
        on_log=lambda step, metrics: logged.append((step, metrics)), eval_every=50,
    )
    after = result.final_eval
    print(f"RM held-out accuracy {before.accuracy:.3f} -> {after.accuracy:.3f}, margin {after.margin_mean:.2f}")
    assert before.accuracy < 0.75
    assert after.accuracy >= 0.90
    assert after.margin_mean > 0.5
    assert after.loss < before.loss
    assert result.evals[0][0] == 50 and len(result.train_loss) == 150
    assert any("rm/eval/accuracy" in metrics for _, metrics in logged)


def test_margin_makes_the_loss_demand_a_gap(tiny_reward_dir, tokenizer):
    """With use_margin, a pair whose scores differ by less than its margin still has a large loss."""
    model = load_reward_model(str(tiny_reward_dir))
    pairs = [PreferencePair("q a", " good", " bad", margin=5.0)] * 32
    plain = train_reward_model(
        model, tokenizer, pairs, [], RewardTrainingConfig(epochs=1, batch_size=32, learning_rate=0.0)
    )
    model_m = load_reward_model(str(tiny_reward_dir))
    with_margin = train_reward_model(
        model_m, tokenizer, pairs, [], RewardTrainingConfig(epochs=1, batch_size=32, learning_rate=0.0, use_margin=True)
    )
    # Same weights (lr 0): the margin shifts the logit by 5, so the loss must be much larger.
    assert with_margin.train_loss[0] > plain.train_loss[0] + 3.0
