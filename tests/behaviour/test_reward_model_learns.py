"""A tiny reward model learns a planted preference rule from pairs (measured held-out accuracy)."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.reward_training import encode_pairs, evaluate_reward_model, train_reward_model
from rlhf_core.data.records import PreferencePair

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


def test_warmup_and_linear_decay_set_each_steps_learning_rate(tiny_reward_dir, tokenizer):
    """The reward model's schedule is the one every loop uses: 2 warm-up steps then a linear decay over 4 steps
    gives 0.5, 1, 1, 0.5 of the peak; the default keeps the peak throughout."""
    rates = {}
    for schedule, warmup in (("linear", 2), ("constant", 0)):
        logged = []
        train_reward_model(load_reward_model(str(tiny_reward_dir)), tokenizer, planted_pairs(32, seed=0), [],
                           RewardTrainingConfig(batch_size=8, learning_rate=0.01, warmup_steps=warmup,
                                                lr_schedule=schedule, max_length=64),
                           on_log=lambda step, metrics: logged.append(metrics["rm/train/lr"]))
        rates[schedule] = logged
    assert rates["linear"] == pytest.approx([0.005, 0.01, 0.01, 0.005])
    assert rates["constant"] == pytest.approx([0.01] * 4)


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


def test_best_epoch_selection_keeps_the_weights_with_the_lowest_eval_loss(tiny_reward_dir, tokenizer):
    """Eval pairs that contradict the training pairs: every epoch makes the eval loss worse, so the weights
    from before training come back bit for bit; eval pairs like the training ones keep a trained epoch."""
    train = planted_pairs(200, seed=0)
    flipped = [PreferencePair(p.prompt, p.rejected, p.chosen) for p in planted_pairs(100, seed=1)]
    config = RewardTrainingConfig(epochs=3, batch_size=16, learning_rate=3e-3, max_length=64, select_best_epoch=True)
    model = load_reward_model(str(tiny_reward_dir))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    undone = train_reward_model(model, tokenizer, train, flipped, config)
    losses = [e.loss for _, e in undone.evals]
    assert [step for step, _ in undone.evals] == [0, 13, 26, 39, 39]  # before, after each epoch, the kept one
    assert losses[1] > losses[0] and undone.best_epoch == 0 and undone.final_eval == undone.evals[0][1]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    model = load_reward_model(str(tiny_reward_dir))
    kept = train_reward_model(model, tokenizer, train, planted_pairs(100, seed=1), config)
    eval_losses = [e.loss for _, e in kept.evals[:4]]
    assert kept.best_epoch == min(range(4), key=eval_losses.__getitem__) > 0
    again = evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, planted_pairs(100, seed=1), 64))
    assert again.loss == pytest.approx(kept.final_eval.loss, abs=1e-6) == eval_losses[kept.best_epoch]


def test_best_epoch_selection_needs_eval_pairs(tiny_reward_dir, tokenizer):
    model = load_reward_model(str(tiny_reward_dir))
    with pytest.raises(ValueError, match="select_best_epoch needs eval pairs"):
        train_reward_model(model, tokenizer, planted_pairs(8, seed=0), [],
                           RewardTrainingConfig(epochs=1, select_best_epoch=True))
