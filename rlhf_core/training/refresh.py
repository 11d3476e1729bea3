"""Reward-model refresh, the pure parts: how fresh on-policy pairs are split and mixed, and when a refreshed
reward model replaces the old one.

The rm-refresh stage (tasks/rm_refresh.py) samples and labels the pairs and trains; these functions decide.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data.records import PreferencePair

Record = Mapping[str, object]


def refresh_seed(seed: int, iteration: int) -> int:
    """The seed of refresh ``iteration``: prompts drawn, replies sampled, annotator noise, splits."""
    return seed * 1000 + iteration


def training_config(base: RewardTrainingConfig, iteration: int, epochs: int, learning_rate: float | None,
                    select_best_epoch: bool) -> RewardTrainingConfig:
    """``base`` (reward_model.training) with the refresh's epochs and learning rate (None = base's), a
    per-iteration shuffle seed, and best-epoch selection when validation pairs are held back for it."""
    return replace(base, epochs=epochs, learning_rate=learning_rate or base.learning_rate,
                   seed=base.seed + iteration, select_best_epoch=select_best_epoch)


def draw_prompts(prompts: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """``n`` prompts without repeats when there are enough, else every prompt as often as needed (shuffled)."""
    if len(prompts) >= n:
        return rng.sample(list(prompts), n)
    drawn: list[str] = []
    while len(drawn) < n:
        drawn += rng.sample(list(prompts), len(prompts))
    return drawn[:n]


def split_by_prompt(records: Sequence[Record], eval_fraction: float, seed: int,
                    prompt_key: str = "prompt") -> tuple[list[Record], list[Record]]:
    """(kept, held) records; a prompt's pairs all land on one side, so the held side is unseen by training."""
    prompts = list(dict.fromkeys(str(r[prompt_key]) for r in records))
    if len(prompts) < 2:
        raise ValueError(f"rm-refresh needs labelled pairs on at least 2 prompts (one to train on, one to evaluate "
                         f"on), got {len(prompts)}; raise refresh.n_pairs or check the refresh quarantine table")
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: min(len(prompts) - 1, max(1, round(eval_fraction * len(prompts))))])
    return [r for r in records if r[prompt_key] not in held], [r for r in records if r[prompt_key] in held]


def replay_sample(old: Sequence[PreferencePair], n_new: int, ratio: float, seed: int) -> list[PreferencePair]:
    """A seeded sample of ``ratio * n_new`` original training pairs (at most all of them)."""
    k = min(len(old), round(ratio * n_new))
    return random.Random(seed).sample(list(old), k)


def promotion(heldout_before: float, heldout_after: float, tolerance: float, changed: bool = True) -> tuple[bool, str]:
    """(promote?, why): promote when held-out accuracy is at least the old RM's minus ``tolerance``. A refresh
    that kept the weights from before training (``changed=False``) is not promoted: the same RM under a new
    version would only restart the detector's history."""
    if not changed:
        return False, ("not promoted: no epoch lowered the validation loss, so the refreshed RM is the old one; "
                       "champion and the RM PPO uses stay as they were")
    if heldout_after >= heldout_before - tolerance:
        if tolerance == 0:
            return True, f"promoted: held-out accuracy {heldout_after:.3f} >= {heldout_before:.3f} of the old RM"
        return True, (f"promoted: held-out accuracy {heldout_after:.3f} >= {heldout_before - tolerance:.3f} (the old "
                      f"RM's {heldout_before:.3f} minus the tolerance {tolerance})")
    return False, (f"not promoted: held-out accuracy fell from {heldout_before:.3f} to {heldout_after:.3f} (tolerance "
                   f"{tolerance}); champion and the RM PPO uses stay as they were")
