"""Sizes of the generated demo task's data. One docstring per field (the seed is the pipeline's ``seed``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from rlhf_core.demo.annotator import DEFAULT_TEMPERATURE
from rlhf_core.ranges import Positive, PositiveInt, Range, check_ranges


@dataclass(frozen=True)
class DemoDataConfig:
    """Sizes of the generated customer-support task (``data.demo``; the split settings are ``data.prep``)."""

    n_pairs: PositiveInt = 4000
    """Preference pairs generated (before validation and dedupe)."""
    n_sft: PositiveInt = 4000
    """SFT demonstrations generated (before dedupe)."""
    sft_eval_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.1
    """Share of demonstration prompts held out for the SFT evaluation loss."""
    n_eval_prompts: PositiveInt = 256
    """Evaluation prompts with hidden metadata, disjoint from every PPO prompt."""
    annotator_temperature: Positive = DEFAULT_TEMPERATURE
    """Noise of the simulated annotator that labels the pairs (smaller = closer to gold)."""

    def __post_init__(self) -> None:
        check_ranges(self, "data.demo")
