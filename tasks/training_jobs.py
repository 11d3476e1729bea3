"""One training run as data: the job a stage builds once, and the one function that runs it.

The reward-model and ppo-iteration stages describe their training as a :class:`RewardModelJob` / :class:`PPOJob`
(settings, input folders and files, how far to train). :func:`run_ppo_job` / :func:`run_reward_job` run it: in the
stage's process, or on every DeepSpeed worker, which reads the same job back from ``job.json``
(``tasks/launch.py`` writes it with :func:`job_to_data`; the worker rebuilds it with :func:`job_from_data`, as
strictly as a config file), so both launch modes build the same models from the same inputs and call the same
``rlhf_core`` training function; only the strategy that applies the gradients differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig, RewardTrainingConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import PPORunResult, train_ppo
from rlhf_core.training.reward_training import RewardTrainingResult, train_reward_model
from rlhf_core.training.strategy import StrategyFactory
from tasks.io import read_prompts
from tasks.models import build_ppo_models, config_max_positions, load_tokenizer, tokenize_prompts
from tasks.runtime import Runtime
from tasks.typed_yaml import build, config_to_dict

OnLog = Callable[[int, dict[str, float]], None]
Loading = Callable[[str | Path], contextlib.AbstractContextManager[bool]]
"""The block a trained model is loaded in, saying whether it came out partitioned (``zero.partitioned_loading``)."""


@dataclass(frozen=True)
class PPOJob:
    """A PPO training run: ``train_ppo`` on the models built from ``reference_dir`` and ``reward_dir``, over the
    prompts of ``prompts_file``, until ``n_updates`` updates are done."""

    config: PPOConfig
    runtime: Runtime
    seed: int
    """Seeds the value head and a LoRA adapter's A (prompt order and sampling: ``config.seed``)."""
    reference_dir: str
    """The SFT policy (model + tokenizer): the reference, and the policy's start."""
    reward_dir: str
    """The proxy reward model (or ensemble) that scores the rollouts."""
    prompts_file: str
    """The PPO prompt table."""
    n_updates: int
    """Updates done in all when the run ends, those of ``init_from`` included."""
    checkpoint_dir: str
    """Absolute path: where the run checkpoints and resumes from."""
    checkpoint_every: int = 0
    init_from: str | None = None
    """A checkpoint to start from when ``checkpoint_dir`` has none (the previous pipeline iteration's)."""

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.reference_dir)

    def prompts(self, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
        """The tokenized prompts; one too long to leave room for a reply fails, naming the table."""
        room = config_max_positions(self.reference_dir) - self.config.generation.max_new_tokens
        return tokenize_prompts(read_prompts(self.prompts_file), self.prompts_file, tokenizer, room)

    def models(self, tokenizer: PreTrainedTokenizerBase, policy_loading: Loading | None = None) -> PPOModels:
        """Policy, reference, scorer and value model as ``tasks.models.build_ppo_models`` builds them."""
        return build_ppo_models(self.config, self.runtime, self.seed, self.reference_dir, self.reward_dir, tokenizer,
                                policy_loading)


@dataclass(frozen=True)
class RewardModelJob:
    """A reward-model training run: ``train_reward_model`` on ``train``, evaluated on ``evaluate_on`` every
    ``eval_every`` steps. The initial model is not data: the stage builds it (and, launched, saves it for the
    workers beside the job)."""

    training: RewardTrainingConfig
    runtime: Runtime
    train: tuple[PreferencePair, ...]
    evaluate_on: tuple[PreferencePair, ...]
    eval_every: int


Job = PPOJob | RewardModelJob
STAGES: Mapping[type, str] = {PPOJob: "ppo", RewardModelJob: "reward-model"}
"""The stage each kind of job is launched for (the worker's log and the launcher's messages say it)."""


def run_ppo_job(job: PPOJob, on_log: OnLog | None = None, make_strategy: StrategyFactory | None = None,
                policy_loading: Loading | None = None) -> tuple[PPOModels, PPORunResult]:
    """(the trained models, the run's history): ``job`` run to its end (None ``make_strategy``: AdamW in this
    process; a DeepSpeed factory on a worker, with ``policy_loading`` its partitioned load)."""
    tokenizer = job.tokenizer()
    prompts = job.prompts(tokenizer)
    models = job.models(tokenizer, policy_loading)
    result = train_ppo(models, prompts, job.config, job.n_updates, checkpoint_dir=job.checkpoint_dir,
                       checkpoint_every=job.checkpoint_every,
                       on_step=(lambda s: on_log(s.step, s.to_metrics())) if on_log is not None else None,
                       init_from=job.init_from, make_strategy=make_strategy)
    return models, result


def run_reward_job(job: RewardModelJob, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   on_log: OnLog | None = None, make_strategy: StrategyFactory | None = None) -> RewardTrainingResult:
    """``model`` trained in place by ``job``; its history."""
    return train_reward_model(model, tokenizer, job.train, job.evaluate_on, job.training, on_log=on_log,
                              eval_every=job.eval_every, make_strategy=make_strategy)


def job_to_data(job: Job) -> dict[str, Any]:
    """A job as plain JSON-able data (its one serialized form)."""
    return config_to_dict(job)


def job_from_data(data: Mapping[str, Any], stage: str, source: str) -> Job:
    """The job of ``stage`` rebuilt from :func:`job_to_data`'s data as strictly as a config file is read: a bad key or
    value is a one-line error naming it and ``source`` (the job file)."""
    kinds = {name: cls for cls, name in STAGES.items()}
    if stage not in kinds:
        raise ValueError(f"{source}: unknown stage {stage!r}; expected one of {', '.join(map(repr, kinds))}")
    return build(kinds[stage], dict(data), "job", {"job": source})
