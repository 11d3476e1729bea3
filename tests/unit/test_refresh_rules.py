"""The pure rules of a reward-model refresh (rlhf_core/training/refresh.py): promotion, the prompt split, the prompt
draw, the replay sample and each refresh's training settings and seed."""

from __future__ import annotations

import random

import pytest

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.training.refresh import (draw_prompts, promotion, refresh_seed, replay_sample, split_by_prompt,
                                        training_config)


def test_promotion_rule() -> None:
    assert promotion(0.70, 0.70, 0.0)[0] and not promotion(0.70, 0.69, 0.0)[0]
    promoted, reason = promotion(0.70, 0.69, 0.02)
    assert promoted and "0.690 >= 0.680" in reason
    # best-epoch selection kept the weights from before training: nothing new to promote
    promoted, reason = promotion(0.70, 0.70, 0.02, changed=False)
    assert not promoted and "no epoch lowered the validation loss" in reason


def test_split_by_prompt_keeps_each_prompt_on_one_side() -> None:
    records = [{"prompt": f"p{i % 7}", "chosen": f" c{i}", "rejected": " r"} for i in range(30)]
    train, held = split_by_prompt(records, 0.3, seed=4)
    assert len(train) + len(held) == 30 and {r["prompt"] for r in held} and {r["prompt"] for r in train}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert len({r["prompt"] for r in held}) == 2  # round(0.3 * 7)
    assert split_by_prompt(records, 0.3, seed=4) == (train, held)  # seeded
    _, tiny = split_by_prompt(records[:2], 0.01, seed=0)
    assert len(tiny) == 1  # at least one prompt is held, at least one kept
    with pytest.raises(ValueError, match="at least 2 prompts"):
        split_by_prompt(records[:1], 0.3, seed=0)


def test_draw_prompts_repeats_only_when_there_are_too_few() -> None:
    prompts = [f"p{i}" for i in range(5)]
    drawn = draw_prompts(prompts, 3, random.Random(0))
    assert len(drawn) == len(set(drawn)) == 3 and set(drawn) <= set(prompts)
    assert draw_prompts(prompts, 3, random.Random(0)) == drawn  # seeded
    cycled = draw_prompts(prompts, 12, random.Random(1))
    assert len(cycled) == 12 and set(cycled[:5]) == set(cycled[5:10]) == set(prompts)  # whole rounds, each shuffled


def test_replay_sample_takes_ratio_times_the_fresh_pairs_at_most_all() -> None:
    old = [PreferencePair(f"q{i}", " good", " bad") for i in range(10)]
    sample = replay_sample(old, n_new=6, ratio=0.5, seed=3)
    assert len(sample) == 3 and len(set(sample)) == 3 and set(sample) <= set(old)
    assert replay_sample(old, n_new=6, ratio=0.5, seed=3) == sample  # seeded
    assert sorted(replay_sample(old, n_new=40, ratio=1.0, seed=3), key=lambda p: p.prompt) == \
        sorted(old, key=lambda p: p.prompt)
    assert replay_sample(old, n_new=5, ratio=0.0, seed=3) == []


def test_training_config_and_seed_of_a_refresh() -> None:
    base = RewardTrainingConfig(epochs=4, learning_rate=1e-4, seed=5, batch_size=16)
    cfg = training_config(base, iteration=3, epochs=2, learning_rate=None, select_best_epoch=True)
    assert (cfg.epochs, cfg.learning_rate, cfg.seed, cfg.select_best_epoch, cfg.batch_size) == (2, 1e-4, 8, True, 16)
    assert training_config(base, 3, 2, 3e-3, False).learning_rate == 3e-3
    assert refresh_seed(7, 3) == 7003 and refresh_seed(7, 3) != refresh_seed(7, 4)
