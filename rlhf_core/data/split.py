"""Stable ids and the deterministic prompt-level split (hashlib, never Python's salted hash())."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace
from enum import Enum

from rlhf_core.data.config import DataPrepConfig

_SEPARATOR = "\x1f"  # ASCII unit separator: cannot occur in validated text, so ("a","bc") != ("ab","c")
_ID_HEX_CHARS = 16


class Split(str, Enum):
    """Where a prompt (and every pair with that prompt) goes."""

    TRAIN = "train"
    HELDOUT = "heldout"
    PPO = "ppo"


def stable_id(*parts: str) -> str:
    """16 hex characters of SHA-256 over the parts: the same on every machine, run and Python version."""
    digest = hashlib.sha256(_SEPARATOR.join(parts).encode("utf-8")).hexdigest()
    return digest[:_ID_HEX_CHARS]


def pair_id(prompt: str, chosen: str, rejected: str) -> str:
    """Stable id of a preference pair."""
    return stable_id(prompt, chosen, rejected)


def prompt_id(prompt: str) -> str:
    """Stable id of a prompt."""
    return stable_id(prompt)


def prompt_position(prompt: str, salt: str) -> float:
    """Uniform-looking position of the prompt in [0, 1), from SHA-256 of salt + prompt."""
    digest = hashlib.sha256((salt + _SEPARATOR + prompt).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(prompt: str, config: DataPrepConfig, ppo_from_pairs: bool = True) -> Split:
    """The split of a prompt: [0, train) -> TRAIN, [train, train + heldout) -> HELDOUT, rest -> PPO.

    With `ppo_from_pairs` False (a separate prompts file feeds PPO) the PPO share is redistributed to
    train and held-out in proportion.
    """
    return split_at(prompt_position(prompt, config.split_salt), config, ppo_from_pairs)


def split_at(position: float, config: DataPrepConfig, ppo_from_pairs: bool = True) -> Split:
    """The split of a prompt at ``position`` (:func:`prompt_position`); :func:`assign_split`'s rule."""
    train, heldout = config.train_fraction, config.heldout_fraction
    if not ppo_from_pairs:
        train, heldout = train / (train + heldout), heldout / (train + heldout)
    if position < train:
        return Split.TRAIN
    if position < train + heldout:
        return Split.HELDOUT
    return Split.PPO if ppo_from_pairs else Split.HELDOUT


def fractions_with_heldout(prompts: Iterable[str], config: DataPrepConfig,
                           ppo_from_pairs: bool = True) -> tuple[float, float, float] | None:
    """(train, held-out, PPO) fractions in steps of 0.05, nearest to ``config``'s, under which these prompts give at
    least one training and one held-out prompt (and one PPO prompt when PPO draws from the pairs): the values to
    suggest when a split holds out nothing. None when no such fractions exist (too few distinct prompts)."""
    positions = {prompt_position(p, config.split_salt) for p in set(prompts)}
    current = (config.train_fraction, config.heldout_fraction, config.ppo_fraction)
    grid = [i / 20 for i in range(21)]
    candidates = [(t, h, round(1 - t - h, 2)) for t in grid for h in grid if t > 0 and h > 0 and t + h <= 1 + 1e-9]
    found = []
    for fractions in candidates:
        trial = replace(config, train_fraction=fractions[0], heldout_fraction=fractions[1],
                        ppo_fraction=fractions[2])
        splits = {split_at(position, trial, ppo_from_pairs) for position in positions}
        needed = {Split.TRAIN, Split.HELDOUT} | ({Split.PPO} if ppo_from_pairs and fractions[2] > 0 else set())
        if needed <= splits:
            found.append((sum(abs(a - b) for a, b in zip(fractions, current, strict=True)), fractions))
    return min(found)[1] if found else None
