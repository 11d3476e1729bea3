"""Settings of the data-prep stage. One docstring per field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf_core.data.formats import InputFormat
from rlhf_core.ranges import Fraction, PositiveInt, check_ranges


@dataclass(frozen=True)
class DataPrepConfig:
    """How preference files are read, validated and split."""

    input_format: InputFormat = InputFormat.AUTO
    """Layout of every input file; AUTO detects it per file from its rows' majority (chat if most rows hold lists in
    `chosen`/`rejected`, else TRL if most text rows have a prompt, else HH) and quarantines rows laid out otherwise
    as format_mismatch."""
    max_length: PositiveInt | None = None
    """Longest prompt + response allowed (each side), in tokens when a tokenizer is given (the pipeline gives the
    policy's whenever ``sft.base_model`` is set), else in characters. Longer pairs are quarantined as too_long.
    None = no limit."""
    max_prompt_length: PositiveInt | None = None
    """Longest prompt allowed, in max_length's unit (tokens of the policy's tokenizer when there is one): pairs and
    PPO prompts with a longer prompt are quarantined as prompt_too_long, so every PPO prompt leaves room for a reply
    within the model's positions. Must be < max_length when both are set. None = no limit."""
    max_chars: PositiveInt | None = 100_000
    """Longest prompt, chosen or rejected text allowed, in characters whatever max_length counts (after HH
    splitting or chat rendering): a guard against runaway rows (a 10 MB reply) that holds without max_length or a
    tokenizer. Longer rows are quarantined as field_too_long. None = no cap."""
    max_quarantine_fraction: Fraction = 0.1
    """The stage fails when more than this fraction of all input rows is quarantined (duplicates count)."""
    train_fraction: Fraction = 0.8
    """Share of prompts whose pairs train the reward model."""
    heldout_fraction: Fraction = 0.1
    """Share of prompts whose pairs are held out for reward-model evaluation."""
    ppo_fraction: Fraction = 0.1
    """Share of prompts kept for PPO rollouts (pairs not used). With a separate prompts file this share is
    redistributed to train/held-out in proportion, since PPO prompts come from that file."""
    split_salt: str = "rlhf-data-prep-v1"
    """Mixed into the prompt hash that decides splits: change it to draw a different (still stable) split."""

    def __post_init__(self) -> None:
        check_ranges(self, "data.prep")
        fractions = (self.train_fraction, self.heldout_fraction, self.ppo_fraction)
        if any(f < 0 for f in fractions) or not math.isclose(sum(fractions), 1.0, abs_tol=1e-9):
            raise ValueError(f"data.prep train/heldout/ppo fractions must be >= 0 and sum to 1, got {fractions} (sum "
                             f"{sum(fractions):g}): raising one means lowering another, e.g. data.prep.train_fraction="
                             f"{max(self.train_fraction - (sum(fractions) - 1), 0):g}")
        if self.train_fraction <= 0:
            raise ValueError("data.prep.train_fraction must be > 0: the reward model needs training pairs")
        if None not in (self.max_prompt_length, self.max_length) and self.max_prompt_length >= self.max_length:
            raise ValueError(f"data.prep.max_prompt_length ({self.max_prompt_length}) must be < data.prep.max_length "
                             f"({self.max_length}): a prompt needs room for a response within max_length")
