"""How the evaluation stages sample and score replies: shared by best-of-n and heldout-eval (no stage imports another).

:class:`Judging` is the part of their config slices that says how: a fixed prompt set, PPO's rollout settings at
the evaluation temperature, and the proxy and held-out reward models with their max lengths.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.evaluation.policy_eval import evaluation_generation, fit_max_new_tokens
from rlhf_core.models.scoring import Scorer
from rlhf_core.ppo.rewards import EnsembleAggregation
from tasks.config import PipelineConfig
from tasks.io import read_prompts
from tasks.models import reward_scorer
from tasks.runtime import ModelInput, Runtime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Judging:
    """How replies are sampled and scored for evaluation."""

    runtime: Runtime
    seed: int
    """Seed of the evaluation samples (the reference's replies are the same in every iteration)."""
    n_prompts: int
    """Evaluation prompts scored (``eval.n_prompts``)."""
    temperature: float
    """``eval.temperature``; 0 = greedy."""
    batch_size: int
    """``eval.batch_size``: prompts generated and scored at once."""
    max_tokens_per_forward: int | None
    """``eval.max_tokens_per_forward``: most tokens in one reward-model scoring forward (None = rows only)."""
    generation: GenerationConfig
    """PPO's rollout settings (``ppo.generation``): budget, top-k, top-p."""
    proxy_max_length: int
    """``reward_model.training.max_length``: tokens the proxy RM reads."""
    heldout_max_length: int
    """``reward_model.heldout.max_length``."""
    gold: bool
    """The demo task: score with the hidden gold scorer too."""
    proxy_ensemble: EnsembleAggregation = "mean"
    """How a proxy ensemble's members make its score (``ppo.reward.ensemble``: the score PPO optimises; a single
    proxy's score is its own whatever it says)."""
    proxy_ensemble_coef: float = 1.0
    """``ppo.reward.ensemble_coef`` ('mean_minus_std' only)."""

    @classmethod
    def of(cls, config: PipelineConfig) -> Judging:
        ev, shaping = config.eval, config.ppo.reward
        return cls(Runtime.of(config), config.seed, ev.n_prompts, ev.temperature, ev.batch_size,
                   ev.max_tokens_per_forward, config.ppo.generation,
                   config.reward_model.training.max_length, config.reward_model.heldout.max_length,
                   config.data.source == "demo", shaping.ensemble,
                   shaping.ensemble_coef if shaping.ensemble == "mean_minus_std" else 1.0)

    def sampling(self, model: PreTrainedModel, prompt_ids: list[list[int]],
                 temperature: float | None = None) -> GenerationConfig:
        """Generation settings at ``temperature`` (default the evaluation one), the budget cut to fit the model."""
        budget = fit_max_new_tokens(model, prompt_ids, self.generation.max_new_tokens)
        chosen = self.temperature if temperature is None else temperature
        return evaluation_generation(self.generation, chosen, self.batch_size, budget)

    def scorers(self, proxy: ModelInput, heldout: ModelInput,
                tokenizer: PreTrainedTokenizerBase) -> dict[str, Scorer]:
        """The proxy and held-out reward models as scorers of replies in the policy's tokens."""
        return {"proxy": reward_scorer(self.runtime, proxy.path, tokenizer, self.proxy_max_length, self.batch_size,
                                       self.max_tokens_per_forward, self.proxy_ensemble, self.proxy_ensemble_coef),
                "heldout": reward_scorer(self.runtime, heldout.path, tokenizer, self.heldout_max_length,
                                         self.batch_size, self.max_tokens_per_forward)}


def read_eval_prompts(path: str | Path, n_prompts: int) -> list[str]:
    """The first ``n_prompts`` evaluation prompts (fewer, with a warning, when the table is shorter)."""
    prompts = read_prompts(path, n_prompts)
    if not prompts:
        raise ValueError(f"{path} holds no prompts; evaluation needs at least one")
    if len(prompts) < n_prompts:
        log.warning("%s holds %d prompts, fewer than eval.n_prompts=%d; evaluating all of them",
                    path, len(prompts), n_prompts)
    return prompts
