"""A PPO training run as data, and the one function that runs it, in the stage's process or on DeepSpeed workers.

The ppo-iteration stage describes its training once as a :class:`PPOJob` (settings, input folders and files, how far
to train) and hands it to :func:`train_ppo_job`: without ``distributed.deepspeed_config`` that is
:func:`run_ppo_job` here; with it, ``tasks.launch`` writes the job as data into ``job.json`` and starts the workers
(``python -m tasks.ppo_job --job <job.json>``), each of which rebuilds it as strictly as a config file
(``tasks.distributed_train.run_worker``) and runs the same :func:`run_ppo_job` with a DeepSpeed strategy. Either
way the same models are built from the same inputs and ``train_ppo`` runs them; launched, the stage builds its models
only after the workers end, from their final checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import PPORunResult, load_checkpoint_weights, train_ppo
from rlhf_core.training.strategy import StrategyFactory
from tasks.config import DistributedSection
from tasks.io import read_prompts
from tasks.launch import DistributedJob, OnLog, launch_job
from tasks.models import config_max_positions, load_tokenizer, tokenize_prompts
from tasks.ppo_models import build_ppo_models
from tasks.runtime import Runtime

Loading = Callable[[str | Path], contextlib.AbstractContextManager[bool]]
"""The block the policy is loaded in, saying whether it came out partitioned (``zero.partitioned_loading``)."""


@dataclass(frozen=True)
class PPOJob:
    """A PPO training run: ``train_ppo`` on the models built from ``reference_dir`` and ``reward_dir``, over the
    prompts of ``prompts_file``, until ``n_updates`` updates are done."""

    kind: ClassVar[str] = "ppo"

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
        """Policy, reference, scorer and value model as ``tasks.ppo_models.build_ppo_models`` builds them."""
        return build_ppo_models(self.config, self.runtime, self.seed, self.reference_dir, self.reward_dir, tokenizer,
                                policy_loading)


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


def train_ppo_job(job: PPOJob, distributed: DistributedSection | None, on_log: OnLog,
                  workdir: str | os.PathLike[str]) -> tuple[PPOModels, PPORunResult]:
    """(the trained models, the run's history): ``job`` run here (``distributed`` None), or on DeepSpeed workers,
    each building the same models and prompts from the job's folders and files.

    Launched, the stage builds no model until the workers have ended; then it builds them and loads the weights of
    the workers' final checkpoint.
    """
    if distributed is None:
        return run_ppo_job(job, on_log)
    job.prompts(job.tokenizer())  # a prompt table the workers would refuse fails here, before any worker starts
    launch_job(distributed, workdir, job, on_log)
    final = latest_checkpoint(job.checkpoint_dir)
    if final is None:
        raise RuntimeError(f"the PPO workers finished without a checkpoint in {job.checkpoint_dir}; see their log above")
    models = job.models(job.tokenizer())
    state = load_checkpoint_weights(models, job.config, final)
    return models, PPORunResult(history=list(state["history"]))


def train_on_worker(job: DistributedJob, training: PPOJob, deepspeed_config: dict[str, Any], on_log: OnLog | None,
                    world_size: int) -> None:
    """:func:`run_ppo_job` on one DeepSpeed worker: each rank generates its share of every rollout batch; the
    checkpoints go where the stage reads them."""
    from rlhf_core.distributed.zero import DeepSpeedFactory, partitioned_loading  # deepspeed: in workers only

    run_ppo_job(training, on_log, DeepSpeedFactory(deepspeed_config, training.config.micro_batch_size),
                lambda folder: partitioned_loading(deepspeed_config, folder, training.runtime.torch_dtype))


if __name__ == "__main__":
    from tasks.distributed_train import run_worker

    raise SystemExit(run_worker(PPOJob, train_on_worker))
