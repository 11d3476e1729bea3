"""Sizes of the generated demo task's data. One docstring per field (the seed is the pipeline's ``seed``)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.demo.annotator import DEFAULT_TEMPERATURE


@dataclass(frozen=True)
class DemoDataConfig:
    """Sizes of the generated customer-support task (``data.demo``; the split settings are ``data.prep``)."""

    n_pairs: int = 4000
    """Preference pairs generated (before validation and dedupe)."""
    n_sft: int = 4000
    """SFT demonstrations generated (before dedupe)."""
    sft_eval_fraction: float = 0.1
    """Share of demonstration prompts held out for the SFT evaluation loss."""
    n_eval_prompts: int = 256
    """Evaluation prompts with hidden metadata, disjoint from every PPO prompt."""
    annotator_temperature: float = DEFAULT_TEMPERATURE
    """Noise of the simulated annotator that labels the pairs (smaller = closer to gold)."""

    def __post_init__(self) -> None:
        for name in ("n_pairs", "n_sft", "n_eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.demo.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.sft_eval_fraction < 1.0:
            raise ValueError(f"data.demo.sft_eval_fraction must be in (0, 1), got {self.sft_eval_fraction}")
        if self.annotator_temperature <= 0:
            raise ValueError(f"data.demo.annotator_temperature must be > 0, got {self.annotator_temperature}")
