"""Settings of the data-prep stage. One docstring per field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf_core.data.formats import InputFormat


@dataclass(frozen=True)
class DataPrepConfig:
    """How preference files are read, validated and split."""

    input_format: InputFormat = InputFormat.AUTO
    """Layout of every input file; AUTO detects it per file (chat if `chosen` holds lists, else TRL if a
    `prompt` column exists, else HH)."""
    max_length: int | None = None
    """Longest prompt + response allowed (each side), in characters, or in tokens when a tokenizer is given.
    Longer pairs are quarantined as too_long. None = no limit."""
    max_quarantine_fraction: float = 0.1
    """The stage fails when more than this fraction of all input rows is quarantined (duplicates count)."""
    train_fraction: float = 0.8
    """Share of prompts whose pairs train the reward model."""
    heldout_fraction: float = 0.1
    """Share of prompts whose pairs are held out for reward-model evaluation."""
    ppo_fraction: float = 0.1
    """Share of prompts kept for PPO rollouts (pairs not used). With a separate prompts file this share is
    redistributed to train/held-out in proportion, since PPO prompts come from that file."""
    split_salt: str = "rlhf-data-prep-v1"
    """Mixed into the prompt hash that decides splits: change it to draw a different (still stable) split."""

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"data.prep.max_length must be >= 1 or None, got {self.max_length}")
        if not 0.0 <= self.max_quarantine_fraction <= 1.0:
            raise ValueError(f"data.prep.max_quarantine_fraction must be in [0, 1], got {self.max_quarantine_fraction}")
        fractions = (self.train_fraction, self.heldout_fraction, self.ppo_fraction)
        if any(f < 0 for f in fractions) or not math.isclose(sum(fractions), 1.0, abs_tol=1e-9):
            raise ValueError(f"data.prep train/heldout/ppo fractions must be >= 0 and sum to 1, got {fractions}")
        if self.train_fraction <= 0:
            raise ValueError("data.prep.train_fraction must be > 0: the reward model needs training pairs")
