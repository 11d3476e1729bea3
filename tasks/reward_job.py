"""A reward-model training run as data, and the one function that runs it, in the stage's process or on DeepSpeed
workers.

The reward-model stage describes each training as a :class:`RewardModelJob` (settings, pairs, how often to evaluate)
and hands it to :func:`fit_reward_model` with the model to train: without ``distributed.deepspeed_config`` that is
:func:`run_reward_job` here; with it, the stage saves the initial model beside the job (``initial/``) and drops it,
``tasks.launch`` writes the job as data into ``job.json`` and starts the workers (``python -m tasks.reward_job --job
<job.json>``), each of which rebuilds it as strictly as a config file (``tasks.distributed_train.run_worker``) and
runs the same :func:`run_reward_job` with a DeepSpeed strategy; the stage then
rebuilds the model from ``initial/`` and loads the weights rank 0 saved.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.reward_training import RewardEval, RewardTrainingResult, train_reward_model
from rlhf_core.training.strategy import StrategyFactory
from tasks.config import DistributedSection
from tasks.launch import DistributedJob, OnLog, fresh_workdir, launch_job
from tasks.models import load_tokenizer
from tasks.runtime import Runtime

INITIAL_DIR = "initial"
"""The folder of the job's workdir holding the initial model and its tokenizer."""
TRAINED_FILE, HISTORY_FILE = "trained.safetensors", "history.json"
"""What rank 0 leaves in the workdir."""


@dataclass(frozen=True)
class RewardModelJob:
    """A reward-model training run: ``train_reward_model`` on ``train``, evaluated on ``evaluate_on`` every
    ``eval_every`` steps. The initial model is not data: the stage builds it (and, launched, saves it for the
    workers beside the job)."""

    kind: ClassVar[str] = "reward-model"

    training: RewardTrainingConfig
    runtime: Runtime
    train: tuple[PreferencePair, ...]
    evaluate_on: tuple[PreferencePair, ...]
    eval_every: int


def run_reward_job(job: RewardModelJob, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   on_log: OnLog | None = None, make_strategy: StrategyFactory | None = None) -> RewardTrainingResult:
    """``model`` trained in place by ``job``; its history."""
    return train_reward_model(model, tokenizer, job.train, job.evaluate_on, job.training, on_log=on_log,
                              eval_every=job.eval_every, make_strategy=make_strategy)


def fit_reward_model(job: RewardModelJob, initial: Callable[[], PreTrainedModel], tokenizer: PreTrainedTokenizerBase,
                     distributed: DistributedSection | None, on_log: OnLog,
                     workdir: str | os.PathLike[str]) -> tuple[PreTrainedModel, RewardTrainingResult]:
    """(the trained reward model, its history): ``job`` run on the model ``initial()`` builds, here (``distributed``
    None) or on DeepSpeed workers.

    Launched, the stage builds the initial model (its fresh head drawn as in this process), saves it for the
    workers and drops it before they start, so it holds no model while they train; afterwards it rebuilds the
    model from that folder and loads the weights rank 0 saved.
    """
    if distributed is None:
        model = initial()
        return model, run_reward_job(job, model, tokenizer, on_log)
    folder = fresh_workdir(workdir)
    _save_and_drop(initial(), folder / INITIAL_DIR)  # the only reference to the model: gone after this line
    tokenizer.save_pretrained(folder / INITIAL_DIR)
    launch_job(distributed, folder, job, on_log)
    model = load_reward_model(str(folder / INITIAL_DIR), job.runtime.torch_dtype)
    load_model(model, str(folder / TRAINED_FILE))
    history = reward_history_from_json(json.loads((folder / HISTORY_FILE).read_text(encoding="utf-8")))
    return model.to(job.runtime.torch_device), history


def _save_and_drop(model: PreTrainedModel, folder: Path) -> None:
    """Save ``model`` (Hugging Face layout) and free it: the caller passed its only reference, which ends with this
    call; the collector and the accelerator's cache then give its memory back before the workers start."""
    model.save_pretrained(folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reward_history_to_json(result: RewardTrainingResult) -> dict[str, Any]:
    """A training history as plain data (the workers' ``history.json``)."""
    return {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy, "n_truncated": result.n_truncated,
            "seconds": result.seconds, "evals": [[step, asdict(evaluation)] for step, evaluation in result.evals]}


def reward_history_from_json(data: dict[str, Any]) -> RewardTrainingResult:
    """Inverse of :func:`reward_history_to_json`."""
    return RewardTrainingResult(train_loss=list(data["train_loss"]), train_accuracy=list(data["train_accuracy"]),
                                evals=[(int(step), RewardEval(**values)) for step, values in data["evals"]],
                                n_truncated=int(data["n_truncated"]), seconds=float(data["seconds"]))


def train_on_worker(job: DistributedJob, training: RewardModelJob, deepspeed_config: dict[str, Any],
                    on_log: OnLog | None, world_size: int) -> None:
    """:func:`run_reward_job` on this worker's share of every batch, on the model the stage saved in ``initial/``;
    rank 0 (the one with ``on_log``) saves the weights and the history."""
    from rlhf_core.distributed.zero import DeepSpeedFactory, partitioned_loading  # deepspeed: in workers only

    folder, runtime, cfg = Path(job.workdir), training.runtime, training.training
    initial = folder / INITIAL_DIR
    with partitioned_loading(deepspeed_config, str(initial), runtime.torch_dtype) as partitioned:
        model = load_reward_model(str(initial), runtime.torch_dtype)  # ZeRO-3: each rank holds its shard only
    model = model if partitioned else model.to(runtime.torch_device)
    share = math.ceil(cfg.batch_size / world_size)  # pairs per process and step; micro_batch_size of them per forward
    factory = DeepSpeedFactory(deepspeed_config, micro_batch_size=min(share, cfg.micro_batch_size or share))
    result = run_reward_job(training, model, load_tokenizer(initial), on_log, factory)
    factory.built[-1].save_weights(model, folder / TRAINED_FILE)
    if on_log is not None:
        (folder / HISTORY_FILE).write_text(json.dumps(reward_history_to_json(result)), encoding="utf-8")


if __name__ == "__main__":
    from tasks.distributed_train import run_worker

    raise SystemExit(run_worker(RewardModelJob, train_on_worker))
